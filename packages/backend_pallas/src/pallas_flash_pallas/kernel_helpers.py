"""Small helpers the forward and backward kernels share."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_flash_pallas.block_sizes import LANES


def lanes(x: jax.Array, width: int) -> jax.Array:
    """``[rows, 128]`` with equal lanes to ``[rows, width]``."""
    if width % LANES == 0:
        return jnp.tile(x, (1, width // LANES))
    if width < LANES:
        return x[:, :width]
    return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def both(a: jax.Array | None, b: jax.Array) -> jax.Array:
    """``a & b``, where a None ``a`` (no mask) means all True."""
    return b if a is None else a & b


def when(condition: bool | jax.Array, body: Callable[[], None]) -> None:
    """Runs ``body`` if ``condition`` is True, under ``pl.when`` if it is traced."""
    if condition is True:
        body()
    else:
        pl.when(condition)(body)
