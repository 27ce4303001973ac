"""The Split-KV decode kernel that copies its blocks itself, by the page: several pages per
grid step, the next step's pages while this step computes. It reads a paged cache through
its page table, and a contiguous cache as pages of `CONTIGUOUS_PAGE` positions (page ``j`` of
sequence ``b`` is ``cache[b, :, j x 128 : (j + 1) x 128]``), so that a sequence's last block
is copied only as far as its length reaches.

Layouts as `kernel`'s: q ``[batch, kv_heads, group, head_dim]``; pages ``[num_pages, kv_heads,
page_size, head_dim]`` (int8 with float32 scales ``[num_pages, kv_heads, page_size]``; or one
packed uint32 pool, `pallas_flash.kv_packing`) with
``page_table [batch, pages_per_sequence]``, or a contiguous cache ``[batch, kv_heads, max_len,
head_dim]`` (scales ``[batch, kv_heads, max_len]``); outputs ``[batch, 1, kv_heads, group,
head_dim]`` and ``[batch, 1, kv_heads, group]`` (one split), float32.

Grid ``(batch, steps)``, run in order: step ``(b, i)`` folds pages ``[i, i + 1) x
pages_per_step`` of sequence ``b``. A page of 128 positions is a small step (a few hundred
cycles of pipeline bookkeeping against 512 KiB of bf16 K/V, 256 KiB in int8); a block spec
can only fetch one page per step, and copies the whole of a block however little of it a
sequence fills. So the kernel copies its pages itself from the cache (in ``pl.ANY``) into
their rows of a double-buffered VMEM block ``[kv_heads, pages_per_step x page_size,
head_dim]``: a paged cache one DMA of ``[kv_heads, page_size, head_dim]`` per page; a
contiguous one, whose pages of a step lie side by side, one DMA per set bit of the number of
pages the step holds (`binary_chunks`: 7 pages as 4 + 2 + 1), since each DMA costs issue
cycles (v5e, Llama-3-8B serving shape, 16 pages a step: 156 us a layer copied by the page,
105 us in chunks, against 128 us of HBM time). A step waits
for its own copies and starts those of the next step that holds a position: the next block of
its sequence, or the first of the next sequence that is not empty (``first_from [batch +
1]``, scalar-prefetched: the first non-empty sequence at or after each one, computed before
the kernel), so they land while it computes; the grid's first step starts the copies of the
first step that holds a position. Every step's copies are thus started by a region whose
predicate the step decides alone: none is left for the rare case of a sequence after an
empty one (a static schedule charges such a region to every step that might run it). An SMEM
counter of the steps that held a position carries the buffer parity from step to step. Pages
past a sequence's length are never copied; their rows of the block keep older data, which
`fold.fold_block` masks (K) and zeroes (V) like any stale slot.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import tpu
from pallas_flash.kv_packing import PACKED_DTYPE
from pallas_flash.memory_space import in_hbm
from pallas_flash.specs import DecodeSpec
from pallas_flash_splitkv import fold
from pallas_flash_splitkv.blocks import LANES, DecodeBlocks

_F32 = jnp.float32

CONTIGUOUS_PAGE = LANES
"""Positions of a page of a contiguous cache: lane-aligned (a page of int8 scales is a slice
of their last axis), and at most 127 positions copied past a sequence's length."""

CONTIGUOUS_KERNEL_NAME = "pallas_flash_split_kv_decode_contiguous_pages"
PAGED_KERNEL_NAME = "pallas_flash_split_kv_decode_paged"
"""The kernel's name where it reads a contiguous cache, and where it reads a paged one."""


def _kernel(
    lengths_ref: jax.Ref,
    *refs: jax.Ref,
    tiling: fold.Tiling,
    pages_per_step: int,
    pages_per_sequence: int,
    num_pages: int,
    batch: int,
) -> None:
    """One grid step ``(b, i)`` (module doc). Refs: the flat page table when paged (SMEM);
    ``first_from`` (SMEM); q; the cache's arrays in HBM (k, v and, when quantized, their
    scales; packed: its words); the outputs; scratch: running max, sum and accumulator (as
    `kernel`), one double-buffered block per cache array, DMA semaphores ``[2, arrays]`` and
    the SMEM count of steps that held a position.
    """
    table_ref, refs = (refs[0], refs[1:]) if tiling.paged else (None, refs)
    first_from_ref, q_ref, *refs = refs
    arrays = 4 if tiling.quantized else 1 if tiling.packed else 2
    cache, (o_ref, lse_ref, m_ref, l_ref, acc_ref) = refs[:arrays], refs[arrays : arrays + 5]
    blocks, (sems, folded) = refs[arrays + 5 : 2 * arrays + 5], refs[2 * arrays + 5 :]
    page_size = tiling.block_kv // pages_per_step
    b, i = pl.program_id(0), pl.program_id(1)

    def copies(seq: jax.Array, step: jax.Array, slot: jax.Array, act: Callable) -> None:
        """``act`` on the copies of the pages of step ``(seq, step)`` that hold a position:
        one per page of a paged cache; a contiguous cache's ``n`` pages as one copy per bit
        of ``n`` (`binary_chunks`), or one per page where that is no more copies (2 a step)."""
        used = pl.cdiv(fold.clipped_length(lengths_ref, seq, tiling.max_len), page_size)

        def copy_rows(index: tuple, rows: pl.Slice) -> None:
            for a, (src, dst) in enumerate(zip(cache, blocks, strict=True)):
                act(pltpu.make_async_copy(src.at[index], dst.at[slot, :, rows], sems.at[slot, a]))

        def copy_page(k: int) -> None:
            j = jnp.minimum(step * pages_per_step + k, pages_per_sequence - 1)
            if tiling.paged:
                page = jnp.clip(table_ref[seq * pages_per_sequence + j], 0, num_pages - 1)
                index = (page,)
            else:
                index = (seq, slice(None), pl.ds(j * page_size, page_size))
            copy_rows(index, pl.ds(k * page_size, page_size))

        def copy_chunk(first: jax.Array, size: int) -> None:
            start = (step * pages_per_step + first) * page_size
            rows = pl.ds(pl.multiple_of(first * page_size, page_size), size * page_size)
            copy_rows((seq, slice(None), pl.ds(pl.multiple_of(start, page_size),
                                               size * page_size)), rows)  # fmt: skip

        if tiling.paged or len(binary_chunks(pages_per_step)) >= pages_per_step:
            for k in range(pages_per_step):
                pl.when(step * pages_per_step + k < used)(functools.partial(copy_page, k))
            return
        held = jnp.clip(used - step * pages_per_step, 0, pages_per_step)
        for size in binary_chunks(pages_per_step):
            first = held & ~(2 * size - 1)  # the pages of the larger chunks: higher bits
            pl.when(held & size != 0)(functools.partial(copy_chunk, first, size))

    @pl.when((b == 0) & (i == 0))
    def _first_step() -> None:
        folded[0] = 0
        first = first_from_ref[0]

        @pl.when(first < batch)
        def _start_first() -> None:
            copies(first, 0, 0, lambda c: c.start())

    running = fold.StepRefs(q_ref, *(None,) * 4, m_ref, l_ref, acc_ref)  # no block: start, finish

    @pl.when(i == 0)
    def _start() -> None:
        fold.start(running)

    length = fold.clipped_length(lengths_ref, b, tiling.max_len)
    first = i * tiling.block_kv

    @pl.when(first < length)
    def _fold() -> None:
        slot = folded[0] % 2
        copies(b, i, slot, lambda c: c.wait())
        more = first + tiling.block_kv < length
        after = first_from_ref[b + 1]  # the next sequence that is not empty, or batch

        @pl.when(more | (after < batch))
        def _start_next() -> None:
            copies(jnp.where(more, b, after), jnp.where(more, i + 1, 0), 1 - slot,
                   lambda c: c.start())  # fmt: skip

        folded[0] = folded[0] + 1
        views = [block.at[slot] for block in blocks] + [None] * (4 - arrays)
        fold.fold_block(fold.StepRefs(q_ref, *views, m_ref, l_ref, acc_ref), first, length, tiling)

    @pl.when(i == tiling.blocks_per_split - 1)
    def _finish() -> None:
        fold.finish(running, o_ref, lse_ref)


def binary_chunks(pages_per_step: int) -> list[int]:
    """Page counts of a contiguous step's copies, largest first: the powers of two up to
    ``pages_per_step``. A step holding ``n`` pages copies one chunk per set bit of ``n`` (at
    most log2 + 1 copies, not ``n``), each after the larger ones: 7 pages are 4 + 2 + 1.
    Steps of 2 pages copy by the page: as many copies, with simpler offsets (v5e, batch-1
    128k decode: 1,069 bundles a step by the page, 1,147 in chunks)."""
    return [1 << k for k in reversed(range(pages_per_step.bit_length()))]


def pages_per_step(blocks: DecodeBlocks, k_pages: jax.Array, page_table: jax.Array) -> int:
    """Pages a step reads of the pool ``k_pages`` (`DecodeBlocks.for_paged`; 1: the block-spec
    kernel of `kernel` reads it instead): K and V of a page, or a packed pool's words."""
    arrays = 1 if k_pages.dtype == PACKED_DTYPE else 2
    page_bytes = arrays * math.prod(k_pages.shape[1:]) * k_pages.dtype.itemsize
    return blocks.for_paged(page_table.shape[1], k_pages.shape[2], page_bytes)


def contiguous_pages_per_step(blocks: DecodeBlocks, k_cache: jax.Array) -> int | None:
    """Pages of `CONTIGUOUS_PAGE` positions a step copies of the contiguous cache ``k_cache
    [batch, kv_heads, max_len, head_dim]`` (its `DecodeBlocks.for_cache` block), or None where
    the block-spec kernel of `kernel` reads it instead: a cache not a multiple of 128
    positions, a block of one page, several splits (this kernel runs one), a chip with two
    TensorCores, which share out the block-spec kernel's parallel batch axis, or an int8
    cache, whose steps copying four arrays by the page take longer than the block-spec
    kernel's (v5e's static schedule, Llama-2-7B serving: 267 us a layer, against its 246 us
    of HBM time)."""
    _, kv_heads, max_len, head_dim = k_cache.shape
    position_bytes = 2 * kv_heads * head_dim * k_cache.dtype.itemsize  # K and V
    block_kv, splits, _ = blocks.for_cache(max_len, position_bytes)
    one_core = tpu.current_generation().tensorcores == 1
    aligned = max_len % CONTIGUOUS_PAGE == 0 and block_kv % CONTIGUOUS_PAGE == 0
    if not aligned or splits > 1 or not one_core or k_cache.dtype == jnp.int8:
        return None
    per_step = block_kv // CONTIGUOUS_PAGE
    return per_step if per_step > 1 else None


def paged_partials_kernel(
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
    """`kernel.split_partials` of a paged cache, or of a contiguous one (``page_table`` None,
    where `contiguous_pages_per_step` is not None), one split, with the interpreter's settings
    (True: the generic interpreter), or None for Mosaic."""
    batch, kv_heads, group, head_dim = q.shape
    paged = page_table is not None
    quantized = k_scales is not None
    packed = v_cache is None
    if paged:
        num_pages, _, page_size, _ = k_cache.shape
        pages_per_sequence = page_table.shape[1]
        per_step = pages_per_step(blocks, k_cache, page_table)
        prefetch = [lengths, page_table.reshape(-1)]  # flat: SMEM pads a 2-D table's rows
    else:
        num_pages, page_size = batch, CONTIGUOUS_PAGE
        pages_per_sequence = k_cache.shape[2] // page_size
        per_step = contiguous_pages_per_step(blocks, k_cache)
        prefetch = [lengths]
    steps = pl.cdiv(pages_per_sequence, per_step)
    block = per_step * page_size
    tiling = fold.tiling_for(
        q, spec, max_len=pages_per_sequence * page_size, block_kv=block,
        blocks_per_split=steps, paged=paged, quantized=quantized, packed=packed,
    )  # fmt: skip
    prefetch.append(first_non_empty(lengths, tiling.max_len))
    kv = [k_cache] if packed else [k_cache, v_cache]
    cache = kv + ([k_scales, v_scales] if quantized else [])
    scratch = [
        pltpu.VMEM((kv_heads, group, LANES), _F32),
        pltpu.VMEM((kv_heads, group, LANES), _F32),
        pltpu.VMEM((kv_heads, group, head_dim), _F32),
        *(pltpu.VMEM((2, kv_heads, block, *x.shape[3:]), x.dtype) for x in cache),
        pltpu.SemaphoreType.DMA((2, len(cache))),
        pltpu.SMEM((1,), jnp.int32),
    ]

    def out_map(b, i, *refs):
        return b, 0, 0, 0, 0

    out, lse = pl.pallas_call(
        functools.partial(
            _kernel,
            tiling=tiling,
            pages_per_step=per_step,
            pages_per_sequence=pages_per_sequence,
            num_pages=num_pages,
            batch=batch,
        ),
        out_shape=(
            jax.ShapeDtypeStruct((batch, 1, kv_heads, group, head_dim), _F32),
            jax.ShapeDtypeStruct((batch, 1, kv_heads, group, LANES), _F32),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(batch, steps),
            in_specs=[
                pl.BlockSpec((None, kv_heads, group, head_dim), lambda b, i, *refs: (b, 0, 0, 0)),
                *[pl.BlockSpec(memory_space=pl.ANY)] * len(cache),
            ],
            out_specs=(
                pl.BlockSpec((None, None, kv_heads, group, head_dim), out_map),
                pl.BlockSpec((None, None, kv_heads, group, LANES), out_map),
            ),
            scratch_shapes=scratch,
        ),
        # in order: each step starts the copies of the next one
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=False if interpret is None else interpret,
        name=PAGED_KERNEL_NAME if paged else CONTIGUOUS_KERNEL_NAME,
    )(*prefetch, q, *(in_hbm(x, interpret) for x in cache))
    return out, lse[..., 0]


def first_non_empty(lengths: jax.Array, max_len: int) -> jax.Array:
    """``[batch + 1]`` int32: at ``b``, the first sequence ``>= b`` whose length (clipped to
    ``[0, max_len]``, as the kernel reads it) is positive; ``batch`` where none is."""
    batch = lengths.shape[0]
    index = jnp.arange(batch, dtype=jnp.int32)
    holding = jnp.where(jnp.clip(lengths, 0, max_len) > 0, index, batch)
    suffix = jax.lax.cummin(holding, reverse=True)
    return jnp.concatenate([suffix, jnp.array([batch], jnp.int32)]).astype(jnp.int32)
