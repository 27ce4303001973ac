"""In-place writes of one token's keys or values into a preallocated decode cache.

A decode loop that rebuilds its cache with ``jnp.concatenate`` copies the whole cache every
token. `write_token` instead writes each sequence's row with ``dynamic_update_slice``: inside
a jit that donates the cache, XLA updates the buffer in place. A cache whose sequence axis is
split over a mesh is written inside ``shard_map``: each device writes the row only if the
position falls in its own slice, so a write moves no cache data between devices (left to
XLA's partitioner, a dynamic position on a partitioned axis gathers the cache).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

SequenceSplit = tuple[Mesh, tuple[str, ...]]
"""A mesh and the names of its axes that split a cache's sequence axis (axis 2)."""


def _write(cache: jax.Array, row: jax.Array, position: jax.Array) -> jax.Array:
    """``cache [kv_heads, length, head_dim]`` with ``row [kv_heads, head_dim]`` at
    ``position`` when it is in range, else unchanged (its row at the clipped position
    written back)."""
    at = jnp.clip(position, 0, cache.shape[1] - 1)
    keep = jax.lax.dynamic_slice_in_dim(cache, at, 1, axis=1)
    owns = (position >= 0) & (position < cache.shape[1])
    row = jnp.where(owns, row[:, None, :].astype(cache.dtype), keep)
    return jax.lax.dynamic_update_slice_in_dim(cache, row, at, axis=1)


def write_token(
    cache: jax.Array,
    row: jax.Array,
    positions: jax.Array,
    *,
    split: SequenceSplit | None = None,
) -> jax.Array:
    """``cache`` with each sequence's ``row`` written at its position.

    Args:
      cache: ``[batch, kv_heads, max_len, head_dim]``; donate it to the enclosing jit so the
        write happens in place.
      row: ``[batch, kv_heads, head_dim]``, cast to the cache's dtype.
      positions: ``[batch]`` int32; a sequence whose position is outside ``[0, max_len)``
        is left unchanged.
      split: the mesh axes that split the cache's sequence axis: each device writes only its
        own contiguous slice (``max_len / devices`` positions), inside ``shard_map``.
    """
    if split is None or not split[1]:
        return jax.vmap(_write)(cache, row, positions)
    mesh, axes = split
    part = cache.shape[2] // math.prod(mesh.shape[name] for name in axes)

    def on_device(cache, row, positions):
        first = jax.lax.axis_index(axes) * part
        return jax.vmap(_write)(cache, row, positions - first)

    local = PartitionSpec(None, None, axes, None)
    return jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(local, PartitionSpec(), PartitionSpec()),
        out_specs=local,
        check_vma=False,
    )(cache, row, positions)
