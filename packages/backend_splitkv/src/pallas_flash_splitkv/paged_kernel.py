"""The Split-KV decode kernel of a paged cache: several pages per grid step, copied through
the page table by the kernel itself, the next step's pages while this step computes.

Layouts as `kernel`'s: q ``[batch, kv_heads, group, head_dim]``; pages ``[num_pages, kv_heads,
page_size, head_dim]`` (int8 with float32 scales ``[num_pages, kv_heads, page_size]``);
``page_table [batch, pages_per_sequence]``; outputs ``[batch, 1, kv_heads, group, head_dim]``
and ``[batch, 1, kv_heads, group]`` (one split), float32.

Grid ``(batch, steps)``, run in order: step ``(b, i)`` folds pages ``[i, i + 1) x
pages_per_step`` of sequence ``b``. A page of 128 positions is a small step (a few hundred
cycles of pipeline bookkeeping against 512 KiB of bf16 K/V, 256 KiB in int8); a block spec
can only fetch one page per step, so the kernel copies its pages itself: each page of the
block is one DMA of ``[kv_heads, page_size, head_dim]`` from the pool (pages in ``pl.ANY``)
into its rows of a double-buffered VMEM block ``[kv_heads, pages_per_step x page_size,
head_dim]``. A step waits for its own copies and starts those of the next step that holds a
position: the next block of its sequence, or the first of the next sequence that is not
empty (``first_from [batch + 1]``, scalar-prefetched: the first non-empty sequence at or after
each one, computed before the kernel), so they land while it computes; the grid's first step
starts the copies of the first step that holds a position. Every step's copies are thus
started by a region whose predicate the step decides alone: none is left for the rare case
of a sequence after an empty one (a static schedule charges such a region to every step
that might run it). An SMEM counter of the steps that held a position carries the buffer
parity from step to step. Pages past a sequence's length are never copied; their rows of the
block keep older data, which `fold.fold_block` masks (K) and zeroes (V) like any stale slot.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash.specs import DecodeSpec
from pallas_flash_splitkv import fold
from pallas_flash_splitkv.blocks import LANES, DecodeBlocks

_F32 = jnp.float32


def _kernel(
    lengths_ref: jax.Ref,
    table_ref: jax.Ref,
    first_from_ref: jax.Ref,
    q_ref: jax.Ref,
    *refs: jax.Ref,
    tiling: fold.Tiling,
    pages_per_step: int,
    pages_per_sequence: int,
    num_pages: int,
    batch: int,
) -> None:
    """One grid step ``(b, i)`` (module doc). Refs after q: the pool's arrays in HBM (k, v
    and, when quantized, their scales); the outputs; scratch: running max, sum and
    accumulator (as `kernel`), one double-buffered block per pool array, DMA semaphores
    ``[2, arrays]`` and the SMEM count of steps that held a position.
    """
    arrays = 4 if tiling.quantized else 2
    pool, (o_ref, lse_ref, m_ref, l_ref, acc_ref) = refs[:arrays], refs[arrays : arrays + 5]
    blocks, (sems, folded) = refs[arrays + 5 : 2 * arrays + 5], refs[2 * arrays + 5 :]
    page_size = tiling.block_kv // pages_per_step
    b, i = pl.program_id(0), pl.program_id(1)

    def copies(seq: jax.Array, step: jax.Array, slot: jax.Array, act: Callable) -> None:
        """``act`` on the copy of every page of step ``(seq, step)`` that holds a position."""
        used = pl.cdiv(fold.clipped_length(lengths_ref, seq, tiling.max_len), page_size)

        def copy_page(k: int) -> None:
            j = step * pages_per_step + k
            entry = seq * pages_per_sequence + jnp.minimum(j, pages_per_sequence - 1)
            page = jnp.clip(table_ref[entry], 0, num_pages - 1)
            rows = pl.ds(k * page_size, page_size)
            for a, (src, dst) in enumerate(zip(pool, blocks, strict=True)):
                act(pltpu.make_async_copy(src.at[page], dst.at[slot, :, rows], sems.at[slot, a]))

        for k in range(pages_per_step):
            pl.when(step * pages_per_step + k < used)(functools.partial(copy_page, k))

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


def pages_per_step(blocks: DecodeBlocks, k_pages: jax.Array, page_table: jax.Array) -> int:
    """Pages a step reads of the pool ``k_pages`` (`DecodeBlocks.for_paged`; 1: the block-spec
    kernel of `kernel` reads it instead)."""
    page_bytes = 2 * math.prod(k_pages.shape[1:]) * k_pages.dtype.itemsize  # K and V
    return blocks.for_paged(page_table.shape[1], k_pages.shape[2], page_bytes)


def paged_partials_kernel(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_table: jax.Array,
    k_scales: jax.Array | None,
    v_scales: jax.Array | None,
    *,
    spec: DecodeSpec,
    blocks: DecodeBlocks,
    interpret: pltpu.InterpretParams | bool | None,
) -> tuple[jax.Array, jax.Array]:
    """`kernel.split_partials` of a paged cache (one split), with the interpreter's settings
    (True: the generic interpreter), or None for Mosaic."""
    batch, kv_heads, group, head_dim = q.shape
    num_pages, _, page_size, _ = k_pages.shape
    pages_per_sequence = page_table.shape[1]
    quantized = k_scales is not None
    per_step = pages_per_step(blocks, k_pages, page_table)
    steps = pl.cdiv(pages_per_sequence, per_step)
    block = per_step * page_size
    tiling = fold.tiling_for(
        q, spec, max_len=pages_per_sequence * page_size, block_kv=block,
        blocks_per_split=steps, paged=True, quantized=quantized,
    )  # fmt: skip
    pool = [k_pages, v_pages] + ([k_scales, v_scales] if quantized else [])
    scratch = [
        pltpu.VMEM((kv_heads, group, LANES), _F32),
        pltpu.VMEM((kv_heads, group, LANES), _F32),
        pltpu.VMEM((kv_heads, group, head_dim), _F32),
        *(pltpu.VMEM((2, kv_heads, block, *x.shape[3:]), x.dtype) for x in pool),
        pltpu.SemaphoreType.DMA((2, len(pool))),
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
            num_scalar_prefetch=3,
            grid=(batch, steps),
            in_specs=[
                pl.BlockSpec((None, kv_heads, group, head_dim), lambda b, i, *refs: (b, 0, 0, 0)),
                *[pl.BlockSpec(memory_space=pl.ANY)] * len(pool),
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
        name="pallas_flash_split_kv_decode_paged",
    )(lengths, page_table.reshape(-1), first_non_empty(lengths, tiling.max_len), q, *pool)
    return out, lse[..., 0]


def first_non_empty(lengths: jax.Array, max_len: int) -> jax.Array:
    """``[batch + 1]`` int32: at ``b``, the first sequence ``>= b`` whose length (clipped to
    ``[0, max_len]``, as the kernel reads it) is positive; ``batch`` where none is."""
    batch = lengths.shape[0]
    index = jnp.arange(batch, dtype=jnp.int32)
    holding = jnp.where(jnp.clip(lengths, 0, max_len) > 0, index, batch)
    suffix = jax.lax.cummin(holding, reverse=True)
    return jnp.concatenate([suffix, jnp.array([batch], jnp.int32)]).astype(jnp.int32)
