"""The Split-KV decode kernels: partial attention of one query token per sequence over splits
of one device's KV cache, contiguous or paged, bfloat16/float32 or int8.

Layouts: q ``[batch, kv_heads, group, head_dim]`` (the query heads of each kv head together:
a free view of ``[batch, q_heads, head_dim]``); ``lengths [batch]`` int32. The caches are

- contiguous: ``[batch, kv_heads, max_len, head_dim]``;
- paged: ``[num_pages, kv_heads, page_size, head_dim]`` with ``page_table [batch,
  pages_per_sequence]`` int32: position ``p`` of sequence ``b`` is row ``p % page_size`` of
  page ``page_table[b, p // page_size]``.

An int8 cache comes with float32 scales of the cache's shape without ``head_dim`` (one per
token and kv head); its values are ``int8 * scale``. A packed paged cache is one uint32 pool
of keys and values (``v_cache`` None, `pallas_flash.kv_packing`), one copy a page. Outputs
per split: the normalised partial output ``[batch, splits, kv_heads, group, head_dim]`` and
its log-sum-exp ``[batch, splits, kv_heads, group]``, both float32.

This module's kernel reads its blocks through block specs: grid ``(batch, splits, blocks per
split)``, the first two axes parallel, the last sequential. A block is ``block_kv`` positions
of every kv head, one DMA of ``[kv_heads, block_kv, head_dim]`` per step for K and for V, read
once for all ``group`` query heads of each kv head (GQA/MQA read each cache byte once), folded
as `fold` says; a paged cache's block is a page, its index maps reading the table. Where
pages are small (`DecodeBlocks.for_paged` gives several per step), a paged cache is read by
`paged_kernel` instead, whose steps copy several pages themselves; so is a contiguous cache
whose block spans several pages of 128 positions (`paged_kernel.contiguous_pages_per_step`),
so that a ragged batch's last blocks are copied only as far as each sequence reaches.

``lengths`` (and the page table) are prefetched into SMEM. ``lengths`` is clipped to ``[0,
max_len]`` where it is read, and page indices to ``[0, num_pages)``: traced values cannot be
checked beforehand, and nothing may be read outside the cache. The index maps re-point the
steps past ``ceil(lengths[b] / block_kv)`` blocks at the last valid block, so no DMA is
issued for them, and the kernel skips them. Cache slots at and past ``lengths[b]`` may hold
anything, NaN included."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import interpret
from pallas_flash.specs import DecodeSpec
from pallas_flash_splitkv import fold
from pallas_flash_splitkv.blocks import LANES, DecodeBlocks
from pallas_flash_splitkv.paged_kernel import (
    contiguous_pages_per_step,
    paged_partials_kernel,
    pages_per_step,
)

_F32 = jnp.float32


def _kernel(*refs: jax.Ref, tiling: fold.Tiling) -> None:
    """One grid step ``(b, s, t)``: folds block ``s * blocks_per_split + t`` of every kv head.

    Refs, in order: ``lengths [batch]`` and, when paged, the flat page table (SMEM); q
    ``[kv_heads, group, head_dim]``; k, v ``[kv_heads, block_kv, head_dim]`` (packed: the
    words alone); when quantized,
    their scales ``[kv_heads, block_kv]``; outputs ``[kv_heads, group, head_dim]`` and
    log-sum-exp ``[kv_heads, group, 128]`` (equal lanes); scratch: running max and sum
    ``[kv_heads, group, 128]`` and accumulator ``[kv_heads, group, head_dim]``, float32.
    """
    lengths_ref, *refs = refs
    if tiling.paged:
        refs = refs[1:]  # the page table: read by the index maps only
    if tiling.packed:
        refs[2:2] = [None]  # k holds the values too
    if not tiling.quantized:
        refs[3:3] = [None, None]
    q_ref, k_ref, v_ref, ks_ref, vs_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
    step = fold.StepRefs(q_ref, k_ref, v_ref, ks_ref, vs_ref, m_ref, l_ref, acc_ref)

    b, s, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = fold.clipped_length(lengths_ref, b, tiling.max_len)
    first = (s * tiling.blocks_per_split + t) * tiling.block_kv  # the block's first position

    @pl.when(t == 0)
    def _start() -> None:
        fold.start(step)

    @pl.when(first < length)
    def _fold() -> None:
        fold.fold_block(step, first, length, tiling)

    @pl.when(t == tiling.blocks_per_split - 1)
    def _finish() -> None:
        fold.finish(step, o_ref, lse_ref)


def split_partials(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    page_table: jax.Array | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    *,
    spec: DecodeSpec,
    blocks: DecodeBlocks,
    devices: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Partial outputs and log-sum-exps of each split (layouts in the module doc).

    Runs the kernel as Mosaic or interpreted, as `pallas_flash.interpret` decides.

    Args:
      q: ``[batch, kv_heads, group, head_dim]``.
      k_cache, v_cache: contiguous or paged (module doc), dtype of q or int8; or, paged and
        packed, ``k_cache`` the uint32 pool of both and ``v_cache`` None.
      lengths: ``[batch]`` int32; values past ``[0, max_len]`` count as the nearest end.
      page_table: ``[batch, pages_per_sequence]`` int32 for a paged cache, else None.
      k_scales, v_scales: float32, the caches' shapes without ``head_dim``, for an int8 cache.
      spec: the call's settings.
      blocks: the tiling (`DecodeBlocks`).
      devices: how many devices run the kernel at once (inside ``shard_map``).

    Returns:
      ``(out, lse)``: ``[batch, splits, kv_heads, group, head_dim]`` and
      ``[batch, splits, kv_heads, group]``, float32.

    Raises:
      ValueError: ``blocks`` is illegal for this cache.
    """
    if page_table is None:
        by_pages = contiguous_pages_per_step(blocks, k_cache) is not None
        kernel = _paged_split_partials if by_pages else _block_spec_partials
        return kernel(
            q, k_cache, v_cache, lengths, None, k_scales, v_scales,
            spec=spec, blocks=blocks, devices=devices,
        )  # fmt: skip
    pool = [x for x in (k_cache, v_cache, k_scales, v_scales) if x is not None]
    paged = _paged_partials(spec, blocks, devices)
    return paged(q, lengths, page_table, *pool)


def _cache_arrays(pool: tuple[jax.Array, ...]) -> tuple[jax.Array | None, ...]:
    """``k, v, k_scales, v_scales`` of a paged cache's arrays: a packed cache's words alone
    (``v`` None), k and v, or k and v then their int8 scales."""
    if len(pool) == 1:
        return pool[0], None, None, None
    return (*pool, None, None)[:4]


@functools.cache
def _paged_partials(spec: DecodeSpec, blocks: DecodeBlocks, devices: int) -> Callable[..., Any]:
    """`split_partials` of a paged cache, ``(q, lengths, page_table, *pool)`` (``pool``: k and
    v, then an int8 cache's scales; or a packed cache's words), with a batching rule of its
    own: the generic one (`pallas_flash.interpret.fold_vmap_into_batch`)
    folds every argument's mapped axis into its first, which for a pool of pages is the page
    axis, so each slice's table would index the first slice's pool. Here a mapped pool is
    folded with each slice's table entries (clipped into its own pool) offset by the pages
    before it; an unmapped pool is shared as it is, not copied per slice."""

    def call(q, lengths, table, *pool):
        k, v, k_scales, v_scales = _cache_arrays(pool)
        one_page = pages_per_step(blocks, k, table) == 1
        kernel = _block_spec_partials if one_page else _paged_split_partials
        return kernel(
            q, k, v, lengths, table, k_scales, v_scales,
            spec=spec, blocks=blocks, devices=devices,
        )  # fmt: skip

    folded = jax.custom_batching.custom_vmap(call)

    @folded.def_vmap
    def _rule(axis_size: int, in_batched: list[bool], q, lengths, table, *pool):
        def mapped(x: jax.Array, batched: bool) -> jax.Array:
            return x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))

        def fold_mapped(x: jax.Array) -> jax.Array:
            return x.reshape(axis_size * x.shape[1], *x.shape[2:])

        pool_batched = in_batched[3:]
        table = mapped(table, in_batched[2])
        if any(pool_batched):
            pool = [fold_mapped(mapped(x, b)) for x, b in zip(pool, pool_batched, strict=True)]
            num_pages = pool[0].shape[0] // axis_size
            offsets = jnp.arange(axis_size, dtype=table.dtype)[:, None, None] * num_pages
            table = jnp.clip(table, 0, num_pages - 1) + offsets
        outs = folded(
            fold_mapped(mapped(q, in_batched[0])), fold_mapped(mapped(lengths, in_batched[1])),
            fold_mapped(table), *pool,
        )  # fmt: skip
        outs = jax.tree.map(lambda y: y.reshape(axis_size, -1, *y.shape[1:]), outs)
        return outs, jax.tree.map(lambda _: True, outs)

    return folded


def _block_spec_partials_kernel(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    page_table: jax.Array | None,
    k_scales: jax.Array | None,
    v_scales: jax.Array | None,
    *,
    spec: DecodeSpec,
    blocks: DecodeBlocks,
    interpret: pltpu.InterpretParams | bool | None,
) -> tuple[jax.Array, jax.Array]:
    """`split_partials` of a contiguous cache, or of a paged one a page per step, with the
    interpreter's settings (True: the generic interpreter), or None for Mosaic."""
    batch, kv_heads, group, head_dim = q.shape
    paged = page_table is not None
    quantized = k_scales is not None
    packed = v_cache is None
    if paged:
        num_pages, block_kv = k_cache.shape[0], k_cache.shape[2]
        pages_per_sequence = page_table.shape[1]
        max_len = pages_per_sequence * block_kv
        splits, per_split = blocks.for_pages(pages_per_sequence)
    else:
        max_len = k_cache.shape[2]
        block_kv, splits, per_split = blocks.for_cache(
            max_len, kv_heads * head_dim * 2 * k_cache.dtype.itemsize
        )

    def last_block(b, lengths_ref):
        return jnp.maximum(pl.cdiv(fold.clipped_length(lengths_ref, b, max_len), block_kv) - 1, 0)

    if paged:

        def cache_block(b, s, t, lengths_ref, table_ref):  # past the end: stay on the last page
            j = jnp.minimum(s * per_split + t, last_block(b, lengths_ref))
            page = jnp.clip(table_ref[b * pages_per_sequence + j], 0, num_pages - 1)
            return page, 0, 0

        prefetch = (lengths, page_table.reshape(-1))  # flat: SMEM pads a 2-D table's rows
    else:

        def cache_block(b, s, t, lengths_ref):  # past the sequence's end: stay on its last block
            return b, 0, jnp.minimum(s * per_split + t, last_block(b, lengths_ref))

        prefetch = (lengths,)

    def kv_map(b, s, t, *refs):
        return (*cache_block(b, s, t, *refs), 0)

    def q_map(b, s, t, *refs):
        return b, 0, 0, 0

    def out_map(b, s, t, *refs):
        return b, s, 0, 0, 0

    tiling = fold.tiling_for(
        q, spec, max_len=max_len, block_kv=block_kv, blocks_per_split=per_split, paged=paged,
        quantized=quantized, packed=packed,
    )  # fmt: skip
    kv_spec = pl.BlockSpec((None, kv_heads, block_kv, head_dim), kv_map)
    kv = [k_cache] if packed else [k_cache, v_cache]
    in_specs = [pl.BlockSpec((None, kv_heads, group, head_dim), q_map), *[kv_spec] * len(kv)]
    operands = [q, *kv]
    if quantized:
        in_specs += [pl.BlockSpec((None, kv_heads, block_kv), cache_block)] * 2
        operands += [k_scales, v_scales]
    out, lse = pl.pallas_call(
        functools.partial(_kernel, tiling=tiling),
        out_shape=(
            jax.ShapeDtypeStruct((batch, splits, kv_heads, group, head_dim), _F32),
            jax.ShapeDtypeStruct((batch, splits, kv_heads, group, LANES), _F32),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(batch, splits, per_split),
            in_specs=in_specs,
            out_specs=(
                pl.BlockSpec((None, None, kv_heads, group, head_dim), out_map),
                pl.BlockSpec((None, None, kv_heads, group, LANES), out_map),
            ),
            scratch_shapes=[
                pltpu.VMEM((kv_heads, group, LANES), _F32),
                pltpu.VMEM((kv_heads, group, LANES), _F32),
                pltpu.VMEM((kv_heads, group, head_dim), _F32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=False if interpret is None else interpret,
        name="pallas_flash_split_kv_decode",
    )(*prefetch, *operands)
    return out, lse[..., 0]


_block_spec_partials = interpret.jit_kernel(_block_spec_partials_kernel, ("spec", "blocks"))
_paged_split_partials = interpret.jit_kernel(paged_partials_kernel, ("spec", "blocks"))
