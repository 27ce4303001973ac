"""Split-KV decoding on one device or with the cache split over a mesh.

Layouts: q ``[batch, q_heads, head_dim]``; the cache a `pf.DecodeCache` (contiguous or paged,
float, int8 or, paged, packed); ``lengths [batch]`` int32; the output ``[batch,
q_heads, head_dim]`` in q's dtype.

On one device the kernel's splits are merged by their log-sum-exps (`merge.merge`). Over a
mesh, ``shard_map`` gives each device a contiguous ``max_len / devices`` slice of every
sequence's cache and the query (replicated); each device runs the kernel on its slice with its
part of ``lengths`` (``clip(lengths - first position, 0, slice)``: a device past a sequence's
end sees no position of it and contributes weight 0), and the devices' partial outputs are
merged with one ``pmax`` and one ``psum`` of ``[batch, q_heads, head_dim]``-sized values
(`merge.merge_across`): the cache never crosses the interconnect. A paged cache's pool is
split along its pages instead: each device attends to the positions in its own pages
(`page_shards.local_pages`), so a sequence whose pages are spread over the devices is
decoded by all of them, whatever its length. Without a mesh the cache stays where it is
(`placement.follow`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

import pallas_flash as pf
from pallas_flash.merge import merge, merge_across
from pallas_flash.mesh_placement import call_mesh, place
from pallas_flash.specs import DecodeSpec
from pallas_flash_splitkv import placement
from pallas_flash_splitkv.blocks import DecodeBlocks
from pallas_flash_splitkv.kernel import split_partials
from pallas_flash_splitkv.page_shards import local_pages


def _local(
    q: jax.Array,
    cache: pf.DecodeCache,
    lengths: jax.Array,
    spec: DecodeSpec,
    blocks: DecodeBlocks,
    devices: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Output ``[batch, q_heads, head_dim]`` float32 and log-sum-exp ``[batch, q_heads]`` of
    one device's cache; ``devices``: how many devices run this at once."""
    batch, q_heads, head_dim = q.shape
    kv_heads = cache.k.shape[1]
    grouped = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    out, lse = split_partials(
        grouped,
        cache.k,
        cache.v,
        lengths,
        cache.page_table,
        cache.k_scales,
        cache.v_scales,
        spec=spec,
        blocks=blocks,
        devices=devices,
    )
    out, lse = merge(out, lse, axis=1)
    return out.reshape(batch, q_heads, head_dim), lse.reshape(batch, q_heads)


def _local_pages(
    q: jax.Array,
    cache: pf.DecodeCache,
    lengths: jax.Array,
    parts: int,
    spec: DecodeSpec,
    blocks: DecodeBlocks,
    devices: int,
) -> tuple[jax.Array, jax.Array]:
    """`_local` of one device's part of a pool split into ``parts`` along its pages, its table
    and ``lengths`` from `local_pages` (held pages first).

    The kernel's grid walks ``pages_per_sequence`` steps per sequence, and a step it skips
    still costs its pipeline bookkeeping. A sequence whose pages go round the devices (as
    `PagedKVCache` allocates them) has at most ``ceil(pages_per_sequence / parts)`` of them
    here, so the kernel walks that many columns of the table; the rest of the columns, which
    only another allocation fills, are decoded by a second kernel that runs only when some
    sequence holds more pages here (``lax.cond``), its partials merged with the first's.
    """
    pages_per_sequence, page_size = cache.page_table.shape[1], cache.k.shape[2]
    width = -(-pages_per_sequence // parts)
    if width == pages_per_sequence:
        return _local(q, cache, lengths, spec, blocks, devices)
    held = width * page_size
    table = cache.page_table
    first = _local(q, cache._replace(page_table=table[:, :width]), jnp.minimum(lengths, held),
                   spec, blocks, devices)  # fmt: skip

    def rest() -> tuple[jax.Array, jax.Array]:
        more = jnp.maximum(lengths - held, 0)
        return _local(q, cache._replace(page_table=table[:, width:]), more, spec, blocks, devices)

    def nothing() -> tuple[jax.Array, jax.Array]:
        out, lse = first
        return jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf)

    second = jax.lax.cond(jnp.any(lengths > held), rest, nothing)
    return merge(*(jnp.stack(pair) for pair in zip(first, second, strict=True)), axis=0)


def split_kv_decode(
    q: jax.Array,
    cache: pf.DecodeCache,
    lengths: jax.Array,
    *,
    spec: DecodeSpec,
    blocks: DecodeBlocks,
    mesh: Mesh | None,
) -> jax.Array:
    """Decode output of validated inputs (layouts in the module doc).

    Args:
      q, cache, lengths, spec: as ``pf.Backend.decode``.
      blocks: the kernel's tiling of each device's slice.
      mesh: the devices to split the cache over (a contiguous cache's sequence axis, a paged
        pool's pages), all its axes flattened; one device: no split. None: follow the
        cache's placement (`placement.follow`): the device it is on, or the mesh of a
        ``NamedSharding`` that splits only that axis (a traced cache: one device).

    Raises:
      pf.InvalidInputError: the mesh's devices do not divide ``max_len`` (paged:
        ``num_pages``); with ``mesh=None``, a cache on several devices that is not split
        only along that axis.
    """
    axis = placement.PAGE_AXIS if cache.paged else placement.SEQUENCE_AXIS
    if mesh is None:
        split = placement.follow(cache.k, cache.v, axis)
    else:
        # one device: no split, but inside shard_map, where a cache laid out over an
        # explicit-axis mesh (jax.make_mesh) reaches the kernel as a plain array
        split = (mesh, tuple(mesh.axis_names) if mesh.size > 1 else ())
    if split is None:
        out, _ = _local(q, cache, lengths, spec, blocks)
        return out.astype(q.dtype)
    mesh, axes = split
    parts = math.prod(mesh.shape[name] for name in axes)
    if cache.k.shape[axis] % parts:
        size = "num_pages" if cache.paged else "max_len"
        raise pf.InvalidInputError(
            f"k_cache: expected {size} divisible by the mesh's {parts} devices, "
            f"got {size}={cache.k.shape[axis]}"
        )
    mesh = call_mesh(mesh, (q, cache, lengths))  # for unplaced inputs, an Auto twin
    q, cache, lengths = place((q, cache, lengths), mesh, _in_specs(cache, axes))
    return _sharded(q, cache, lengths, spec=spec, blocks=blocks, mesh=mesh, axes=axes)


def _in_specs(cache: pf.DecodeCache, axes: tuple[str, ...]) -> tuple:
    """How `_sharded` takes (q, cache, lengths): the cache's sequence (paged: pages) axis
    split over ``axes``, the rest replicated."""
    axis = placement.PAGE_AXIS if cache.paged else placement.SEQUENCE_AXIS
    split = [axes or None if i == axis else None for i in range(4)]
    values = PartitionSpec(*split)
    scales = PartitionSpec(*split[:3]) if cache.quantized else None
    table = PartitionSpec() if cache.paged else None
    v_values = None if cache.packed else values
    cache_specs = pf.DecodeCache(values, v_values, table, scales, scales)
    return PartitionSpec(), cache_specs, PartitionSpec()


@functools.partial(jax.jit, static_argnames=("spec", "blocks", "mesh", "axes"))
def _sharded(
    q: jax.Array,
    cache: pf.DecodeCache,
    lengths: jax.Array,
    *,
    spec: DecodeSpec,
    blocks: DecodeBlocks,
    mesh: Mesh,
    axes: tuple[str, ...],
) -> jax.Array:
    """`split_kv_decode` over a mesh whose ``axes`` split the cache (its other axes hold
    copies; no axes: every device decodes the whole cache), as one SPMD program (jitted: every
    device runs its kernel at once, which the TPU interpreter's simulated devices also need)."""
    axis = placement.PAGE_AXIS if cache.paged else placement.SEQUENCE_AXIS
    parts = math.prod(mesh.shape[name] for name in axes)
    part = cache.k.shape[axis] // parts

    def on_device(q, cache, lengths):
        first = jax.lax.axis_index(axes) * part if axes else 0
        if cache.paged:
            table, mine = local_pages(cache.page_table, lengths, first, part, cache.k.shape[2])
            out, lse = _local_pages(q, cache._replace(page_table=table), mine, parts, spec,
                                    blocks, mesh.size)  # fmt: skip
        else:
            mine = jnp.clip(lengths - first, 0, part)
            out, lse = _local(q, cache, mine, spec, blocks, mesh.size)
        if axes:
            out, _ = merge_across(out, lse, axes)
        return out.astype(q.dtype)

    return jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=_in_specs(cache, axes),
        out_specs=PartitionSpec(),
        check_vma=False,
    )(q, cache, lengths)
