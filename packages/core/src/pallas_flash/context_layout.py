"""How a sequence split over ``devices`` devices (context parallelism) is laid out.

``contiguous``: device ``d`` holds chunk ``d`` of ``devices`` equal chunks, in order.
``zigzag``: the sequence is cut into ``2 x devices`` chunks and device ``d`` holds chunks
``d`` and ``2 devices - 1 - d``, one early and one late, so that under a causal mask every
device has the same number of visible query-key pairs. A zigzag layout is the order of the
tokens in the arrays themselves: `to_zigzag` puts a sequence in it (once, e.g. in the data
pipeline, with the positions that go with it), `from_zigzag` takes it back.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

ContextLayout = Literal["contiguous", "zigzag"]
LAYOUTS = ("contiguous", "zigzag")


def pieces(layout: ContextLayout) -> int:
    """Chunks per device."""
    return 2 if layout == "zigzag" else 1


def chunk_ids(device: jax.Array | int, devices: int, layout: ContextLayout) -> list:
    """The indices, along the sequence, of the chunks ``device`` holds, in its order."""
    if layout == "zigzag":
        return [device, 2 * devices - 1 - device]
    return [device]


def _order(devices: int) -> list[int]:
    """The zigzag order of ``2 x devices`` chunks: ``0, 2n-1, 1, 2n-2, ...``."""
    return [c for d in range(devices) for c in (d, 2 * devices - 1 - d)]


def to_zigzag(x: jax.Array, devices: int, axis: int = 2) -> jax.Array:
    """``x`` with its ``axis`` (the sequence; a multiple of ``2 x devices``) in zigzag order,
    so that splitting it evenly over ``devices`` gives device ``d`` chunks ``d`` and
    ``2 devices - 1 - d``."""
    chunks = jnp.split(x, 2 * devices, axis=axis)
    return jnp.concatenate([chunks[c] for c in _order(devices)], axis=axis)


def from_zigzag(x: jax.Array, devices: int, axis: int = 2) -> jax.Array:
    """The inverse of `to_zigzag`: the sequence back in order."""
    chunks = jnp.split(x, 2 * devices, axis=axis)
    position = {c: i for i, c in enumerate(_order(devices))}
    return jnp.concatenate([chunks[position[c]] for c in range(2 * devices)], axis=axis)
