"""In-place writes of one token's keys or values into a preallocated decode cache.

A decode loop that rebuilds its cache with ``jnp.concatenate`` copies the whole cache every
token. `write_token` instead writes each sequence's row in place, inside a jit that donates
the cache: on TPU by one Pallas kernel per array (`pallas_flash.row_write_kernel`), elsewhere
(or where the kernel does not fit) by one ``dynamic_update_slice`` per row. A cache split
over a mesh (a contiguous cache's sequence axis, a paged cache's pages) is written inside
``shard_map``: each device writes a row only if it falls in its own slice, so a write moves
no cache data between devices (left to XLA's partitioner, a dynamic index on a partitioned
axis gathers the cache). `write_pages` writes whole pages of a paged pool (a prompt's K/V),
`write_tokens` a ragged batch's tokens into their pages (several may share a page; on TPU by
one Pallas kernel for keys and values, `pallas_flash.page_write_kernel`), and `write_kv`
(`write_kv_arrays`) writes a layer's keys and values with any of these, quantized to int8
with their scales when the cache is int8, packed into one array when it is packed
(`pallas_flash.kv_packing`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from pallas_flash import interpret, page_write_kernel, row_write_kernel
from pallas_flash.decode_cache import DecodeCache
from pallas_flash.kv_packing import pack_kv
from pallas_flash.mesh_placement import call_mesh, place
from pallas_flash.quantization import quantize_int8

Split = tuple[Mesh, tuple[str, ...]]
"""A mesh and the names of its axes that split one axis of a cache."""


def write_rows(
    cache: jax.Array,
    rows: jax.Array,
    blocks: jax.Array,
    positions: jax.Array,
    *,
    split: Split | None = None,
    split_axis: int = 2,
    distinct_blocks: bool = False,
) -> jax.Array:
    """``cache [blocks, kv_heads, length, ...]`` with ``rows[i] [kv_heads, ...]`` written at
    ``[blocks[i], :, positions[i]]`` for every ``i`` whose block and position are in range;
    the others write nothing. A block is a sequence of a contiguous cache, or a page of a
    paged one; ``...`` is ``head_dim`` for values and nothing for int8 scales.

    With ``distinct_blocks`` (every row in range has a block of its own, as a contiguous
    cache's sequences do) the rows are written by one Pallas kernel when it compiles for a
    TPU (`pallas_flash.row_write_kernel`, where it fits); otherwise by one
    ``dynamic_update_slice`` per row, unrolled (a ``vmap`` of them becomes a scatter, which
    XLA on TPU runs on a re-laid-out copy of the whole cache). Both write the same values.

    Args:
      split: the mesh axes that split the cache's ``split_axis`` (2, positions, for a
        contiguous cache; 0, pages, for a paged one): each device writes only the rows that
        fall in its own contiguous slice, inside ``shard_map``.
      distinct_blocks: no two rows in range share a block.
    """
    write = _write_distinct_rows if distinct_blocks else _write_rows
    return _write_split(write, cache, rows, blocks, positions, split, split_axis)


def _write_split(
    write: Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array],
    cache: jax.Array,
    values: jax.Array,
    blocks: jax.Array,
    positions: jax.Array,
    split: Split | None,
    split_axis: int,
) -> jax.Array:
    """``write(cache, values, blocks, positions)`` on one device, or inside ``shard_map`` on
    each device's slice of ``cache`` along ``split_axis`` (0: blocks, 2: positions), with the
    indices made local: a device writes only what falls in its own slice."""
    if split is None or not split[1]:
        return write(cache, values, blocks, positions)
    mesh, axes = call_mesh(split[0], (cache, values)), split[1]
    part = cache.shape[split_axis] // math.prod(mesh.shape[name] for name in axes)

    def on_device(cache, values, blocks, positions):
        first = jax.lax.axis_index(axes) * part
        if split_axis == 0:
            return write(cache, values, blocks - first, positions)
        return write(cache, values, blocks, positions - first)

    local = PartitionSpec(*(axes if i == split_axis else None for i in range(cache.ndim)))
    in_specs = (local, PartitionSpec(), PartitionSpec(), PartitionSpec())
    return jax.shard_map(on_device, mesh=mesh, in_specs=in_specs, out_specs=local, check_vma=False)(
        *place((cache, values, blocks, positions), mesh, in_specs)
    )


def _write_rows(
    cache: jax.Array, rows: jax.Array, blocks: jax.Array, positions: jax.Array
) -> jax.Array:
    """`write_rows` on one device."""
    return _write_blocks(cache, rows[:, :, None], blocks, positions)


def _write_distinct_rows(
    cache: jax.Array, rows: jax.Array, blocks: jax.Array, positions: jax.Array
) -> jax.Array:
    """`write_rows` on one device of rows whose blocks are distinct: by the Pallas kernel
    where Mosaic compiles it and it fits this device's cache, else as `_write_rows`."""
    mosaic = interpret.interpret_params() is None
    if mosaic and row_write_kernel.fits(cache, rows.shape[0]):
        return row_write_kernel.write_rows_kernel(cache, rows, blocks, positions)
    return _write_rows(cache, rows, blocks, positions)


def _write_blocks(
    cache: jax.Array, spans: jax.Array, blocks: jax.Array, positions: jax.Array
) -> jax.Array:
    """``cache [blocks, kv_heads, length, ...]`` with each ``spans[i] [kv_heads, span, ...]``
    written from ``[blocks[i], :, positions[i]]`` when its block and span are in range (a span
    at clipped indices is written back unchanged)."""
    num_blocks, kv_heads, length = cache.shape[:3]
    span, rest = spans.shape[2], cache.shape[3:]
    for i in range(spans.shape[0]):
        block = jnp.clip(blocks[i], 0, num_blocks - 1)
        at = jnp.clip(positions[i], 0, length - span)
        start = (block, 0, at) + (0,) * len(rest)
        keep = jax.lax.dynamic_slice(cache, start, (1, kv_heads, span, *rest))
        owns = (blocks[i] >= 0) & (blocks[i] < num_blocks)
        owns &= (positions[i] >= 0) & (positions[i] <= length - span)
        new = spans[i].astype(cache.dtype).reshape(1, kv_heads, span, *rest)
        cache = jax.lax.dynamic_update_slice(cache, jnp.where(owns, new, keep), start)
    return cache


def write_pages(
    pool: jax.Array, values: jax.Array, pages: jax.Array, *, split: Split | None = None
) -> jax.Array:
    """``pool [num_pages, kv_heads, page_size, ...]`` with each ``values[i] [kv_heads,
    page_size, ...]`` written as page ``pages[i]``; a page outside ``[0, num_pages)`` (-1: no
    page) is written nowhere. One ``dynamic_update_slice`` per page, unrolled (a scatter would
    re-lay-out a copy of the pool on TPU); ``...`` is ``head_dim``, or nothing for scales.

    Args:
      pool: a paged cache's pages or scales; donate it to the enclosing jit so that the write
        happens in place.
      values: ``[n, kv_heads, page_size, ...]``, cast to the pool's dtype.
      pages: ``[n]`` int32.
      split: the mesh axes that split the pool's pages: each device writes only its own
        pages, inside ``shard_map`` (``values`` are handed to every device).
    """
    return _write_split(_write_blocks, pool, values, pages, jnp.zeros_like(pages), split, 0)


def write_kv(
    cache: DecodeCache,
    k: jax.Array,
    v: jax.Array,
    write: Callable[[jax.Array, jax.Array], jax.Array],
) -> DecodeCache:
    """``cache`` with keys ``k`` and values ``v`` written by ``write(array, values)`` (e.g.
    `write_rows` at given blocks and positions, or `write_pages`). An int8 cache gets them
    quantized by `pallas_flash.quantize_int8` (a scale per ``head_dim`` row), the int8 values
    written into ``k``/``v`` and the scales into ``k_scales``/``v_scales`` by the same
    ``write``; a packed cache gets them packed into its one array (`pallas_flash.pack_kv`); a
    float cache gets them cast to its dtype.

    Args:
      cache: one layer's cache (its ``page_table`` is kept as it is).
      k: new keys ``[..., head_dim]`` in the layout ``write`` takes.
      v: new values, shaped as ``k``.
      write: writes values into one array of the cache and returns it.
    """

    def write_arrays(arrays: Arrays, values: Arrays) -> Arrays:
        return tuple(write(a, x) for a, x in zip(arrays, values, strict=True))

    return write_kv_arrays(cache, k, v, write_arrays)


Arrays = tuple[jax.Array, ...]


def write_kv_arrays(
    cache: DecodeCache, k: jax.Array, v: jax.Array, write_arrays: Callable[[Arrays, Arrays], Arrays]
) -> DecodeCache:
    """`write_kv`, ``write_arrays(arrays, values)`` writing a cache's arrays of one shape at
    once (`write_tokens`): a packed cache's one array, or ``k`` and ``v``, then an int8
    cache's scales."""
    if cache.packed:
        (words,) = write_arrays((cache.k,), (pack_kv(k, v),))
        return cache._replace(k=words)
    if not cache.quantized:
        k_pool, v_pool = write_arrays((cache.k, cache.v), (k, v))
        return cache._replace(k=k_pool, v=v_pool)
    (k8, k_scales), (v8, v_scales) = quantize_int8(k), quantize_int8(v)
    k_pool, v_pool = write_arrays((cache.k, cache.v), (k8, v8))
    k_scales, v_scales = write_arrays((cache.k_scales, cache.v_scales), (k_scales, v_scales))
    return cache._replace(k=k_pool, v=v_pool, k_scales=k_scales, v_scales=v_scales)


def write_token(
    cache: jax.Array,
    row: jax.Array,
    positions: jax.Array,
    *,
    split: Split | None = None,
) -> jax.Array:
    """``cache`` with each sequence's ``row`` written at its position.

    Args:
      cache: ``[batch, kv_heads, max_len, head_dim]`` (or an int8 cache's scales ``[batch,
        kv_heads, max_len]``); donate it to the enclosing jit so the write happens in place.
      row: ``[batch, kv_heads, head_dim]`` (scales: ``[batch, kv_heads]``), cast to the
        cache's dtype.
      positions: ``[batch]`` int32; a sequence whose position is outside ``[0, max_len)``
        is left unchanged.
      split: the mesh axes that split the cache's sequence axis: each device writes only its
        own contiguous slice (``max_len / devices`` positions), inside ``shard_map``.
    """
    batch = jnp.arange(cache.shape[0])
    return write_rows(cache, row, batch, positions, split=split, split_axis=2, distinct_blocks=True)


def write_tokens(
    pools: Sequence[jax.Array],
    values: Sequence[jax.Array],
    pages: jax.Array,
    rows: jax.Array,
    *,
    sequences: int | None = None,
) -> tuple[jax.Array, ...]:
    """Each of ``pools [num_pages, kv_heads, page_size, ...]`` with its ``values[i] [kv_heads,
    ...]`` written at ``[pages[i], :, rows[i]]``; a token whose page is outside ``[0,
    num_pages)`` is written nowhere. A ragged batch's tokens, any number of them in one page, a
    sequence's at consecutive rows and positions (``...``: ``head_dim``, or nothing for
    scales); the pools of one cache, of one shape and dtype (keys and values, or their
    scales); donate them for the writes to be in place.

    On TPU one Pallas kernel writes the chunks that hold a new token, in every pool at once
    (`pallas_flash.page_write_kernel`, where it fits); otherwise one scatter per pool, which
    XLA on TPU may run on a re-laid-out copy of the pool. Both write the same values.
    ``sequences``: how many sequences the tokens belong to, if known (it bounds the kernel's
    work)."""
    mosaic = interpret.interpret_params() is None
    if mosaic and page_write_kernel.fits(pools[0], values[0].shape[0]):
        return page_write_kernel.write_tokens_kernel(
            pools, values, pages, rows, sequences=sequences
        )
    return tuple(_scatter_tokens(p, x, pages, rows) for p, x in zip(pools, values, strict=True))


def _scatter_tokens(
    pool: jax.Array, values: jax.Array, pages: jax.Array, rows: jax.Array
) -> jax.Array:
    """`write_tokens` as one XLA scatter."""
    outside = (pages < 0) | (pages >= pool.shape[0])
    pages = jnp.where(outside, pool.shape[0], pages)  # past the end: dropped, never wrapped
    return pool.at[pages, :, rows].set(values.astype(pool.dtype), mode="drop")
