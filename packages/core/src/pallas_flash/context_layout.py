"""How a sequence split over ``devices`` devices (context parallelism) is laid out.

``contiguous``: device ``d`` holds chunk ``d`` of ``devices`` equal chunks, in order.
``zigzag``: the sequence is cut into ``2 x devices`` chunks and device ``d`` holds chunks
``d`` and ``2 devices - 1 - d``, one early and one late, so that under a causal mask every
device has the same number of visible query-key pairs. A zigzag layout is the order of the
tokens in the arrays themselves: `to_zigzag` puts a sequence in it (once, e.g. in the data
pipeline, with the positions that go with it), `from_zigzag` takes it back.

The K/V chunks reach every device one of two ways (`EXCHANGES`): round a ring, one device
on per step (`kv_device`: at step ``s`` a device holds those of the device ``s`` before it),
or all gathered at once (their gradients then reduce-scattered home); either way each device
meets every chunk once, in the same order. Under a causal mask a pair of chunks is of one of
`PAIR_KINDS` (`pair_kind`), and `ring_pair_kinds` counts them for a device.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

ContextLayout = Literal["contiguous", "zigzag"]
LAYOUTS = ("contiguous", "zigzag")

ContextExchange = Literal["ring", "all_gather"]
EXCHANGES = ("ring", "all_gather")

PAIR_KINDS = ("skip", "diagonal", "unmasked")
"""A causal pair of query and key chunks, by index (`pair_kind`): a later key chunk (no
visible key: skipped), the same chunk (masked causally), an earlier one (every key visible)."""


def pieces(layout: ContextLayout) -> int:
    """Chunks per device."""
    return 2 if layout == "zigzag" else 1


def chunk_ids(device: jax.Array | int, devices: int, layout: ContextLayout) -> list:
    """The indices, along the sequence, of the chunks ``device`` holds, in its order."""
    if layout == "zigzag":
        return [device, 2 * devices - 1 - device]
    return [device]


def kv_device(device: jax.Array | int, step: jax.Array | int, devices: int) -> jax.Array | int:
    """The device whose K/V chunks ``device`` holds at a ring's step ``step`` (one hop a step,
    device ``d``'s to ``d + 1``)."""
    return (device - step) % devices


def pair_kind(q_chunk: jax.Array | int, k_chunk: jax.Array | int) -> jax.Array:
    """The index in `PAIR_KINDS` of a causal pair of chunks (their indices along the
    sequence): 0 skip, 1 diagonal, 2 unmasked."""
    return jnp.sign(jnp.asarray(q_chunk) - jnp.asarray(k_chunk)) + 1


def ring_pair_kinds(device: int, devices: int, layout: ContextLayout) -> dict[str, int]:
    """How many pairs of each of `PAIR_KINDS` ``device`` attends to over a causal ring's
    ``devices`` steps (every query chunk it holds with every K/V chunk it is passed)."""
    counts = dict.fromkeys(PAIR_KINDS, 0)
    for step in range(devices):
        theirs = chunk_ids(kv_device(device, step, devices), devices, layout)
        for q_chunk in chunk_ids(device, devices, layout):
            for k_chunk in theirs:
                counts[PAIR_KINDS[int(pair_kind(q_chunk, k_chunk))]] += 1
    return counts


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
