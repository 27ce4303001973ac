"""Programs the estimate tests compile: module-level, so the estimate's worker imports them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _matmul_kernel(x_ref, y_ref, z_ref) -> None:
    z_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32).astype(
        z_ref.dtype
    )


def blocked_matmul(x: jax.Array, y: jax.Array, *, bm: int, bn: int) -> jax.Array:
    """``x @ y``: x ``[m, k]``, y ``[k, n]``, one Pallas grid step per ``[bm, bn]`` output
    block (the whole of ``k`` at once)."""
    (m, k), n = x.shape, y.shape[1]
    return pl.pallas_call(
        _matmul_kernel,
        grid=(m // bm, n // bn),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
    )(x, y)


def plain_matmul(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x @ y``, XLA's."""
    return x @ y


def doubled(x: jax.Array) -> jax.Array:
    """``2 x``: one elementwise pass over HBM (memory-bound)."""
    return x * 2
