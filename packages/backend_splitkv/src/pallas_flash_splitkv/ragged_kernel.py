"""The ragged paged attention kernel: a flat batch of new tokens (decode tokens and prefill
chunks mixed) against their sequences' paged cache, float or int8.

Layouts: the query per work item ``[items, kv_heads, group x block_q, head_dim]`` (row ``g x
block_q + t``: token ``t`` of the item, query head ``g`` of the kv head; `ragged_blocks`), the
output likewise in q's dtype; pages ``[num_pages, kv_heads, page_size, head_dim]`` (int8 with
float32 scales, gathered per sequence before the kernel: ``[seqs, kv_heads, positions]``,
`_scales_by_sequence`) and the flat page table, scalar-prefetched with ``kv_lengths``,
``query_starts`` and the schedule.

Grid ``(kv_heads / H, items)``, ``H`` kv heads a step (`RaggedBlocks.heads_for`). Step ``(h,
w)`` takes item ``w``'s ``count`` tokens of sequence ``s`` at positions ``p0 .. p0 + count -
1`` on kv heads ``h H`` to ``h H + H - 1`` and folds, by online softmax in float32, the kv
blocks (``pages_per_block`` pages of those heads) that hold a position some row sees:
from ``p0 - window`` (0 without a window) to ``p0 + count - 1``, no further than the
sequence's length; blocks wholly before or after that range are never copied. The blocks are
copied by manual DMA, one per page that holds a position of that range, all ``H`` heads at
once (table entries clipped into ``[0, num_pages)``; int8 scales one copy per block), into a
double-buffered VMEM block: block ``i + 1``'s copies start before block ``i`` is folded, and
an item's last block starts the copies of the next step's first block (the next item of the
heads, else item 0 of the next ``H``: the grid runs in order, an SMEM count of folded blocks
carrying the buffer parity), so no step waits for its first block but the grid's first. All
``group`` query heads of a kv head share one ``[rows, block] @ [block, head_dim]`` matmul, one
per kv head of the step (GQA reads each page once per item). A row sees the positions up to
its own, inside the window; positions outside ``[p0 - window, p0 + count - 1]`` (stale pages,
unwritten slots) are masked and their V rows (int8: V scales) zeroed, since a stale NaN would
poison ``p @ v``. An int8 block is converted to q's dtype and its scales applied to the scores
(K) and to the probabilities (V). Sinks join each row's denominator at the end. Unused items
and rows that see no position give zeros.

A batch makes two calls of the kernel (`ragged_blocks.kernel_calls`): the decoding sequences',
whose items hold one token in the fewest rows that fill whole tiles (``DECODE_KERNEL_NAME``),
and the other sequences', with ``block_q`` tokens an item (``KERNEL_NAME``); each token's
output comes from the call that took its sequence.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import interpret
from pallas_flash.decode_cache import DecodeCache
from pallas_flash.masking import apply_softcap
from pallas_flash.specs import RaggedSpec
from pallas_flash_splitkv import ragged_blocks
from pallas_flash_splitkv.blocks import LANES
from pallas_flash_splitkv.ragged_blocks import RaggedBlocks

_F32 = jnp.float32

KERNEL_NAME, DECODE_KERNEL_NAME = ragged_blocks.KERNEL_NAME, ragged_blocks.DECODE_KERNEL_NAME


def _kernel(
    lengths_ref: jax.Ref,
    starts_ref: jax.Ref,
    table_ref: jax.Ref,
    sequence_ref: jax.Ref,
    first_ref: jax.Ref,
    count_ref: jax.Ref,
    q_ref: jax.Ref,
    *refs: jax.Ref,
    spec: RaggedSpec,
    block_q: int,
    pages_per_block: int,
    pages_per_sequence: int,
    num_pages: int,
    quantized: bool,
    has_sinks: bool,
) -> None:
    """One grid step ``(h, w)``: item ``w`` on kv heads ``h x H`` to ``h x H + H - 1`` (module
    doc). Refs after q ``[H, rows, head_dim]``: sinks ``[H, rows, 128]`` when given; the cache's
    arrays in HBM (k, v and, when quantized, their scales); the output; scratch: running max
    and sum ``[H, rows, 128]``, accumulator ``[H, rows, head_dim]``, one double-buffered block
    per cache array (``[2, H, block_kv, ...]``) and DMA semaphores ``[2, arrays]``."""
    sinks_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    arrays = 4 if quantized else 2
    cache, (o_ref, m_ref, l_ref, acc_ref) = refs[:arrays], refs[arrays : arrays + 4]
    buffers, (sems, folded) = refs[arrays + 4 : 2 * arrays + 4], refs[2 * arrays + 4 :]
    heads = q_ref.shape[0]
    page_size = buffers[0].shape[2] // pages_per_block
    block_kv = pages_per_block * page_size
    max_len = pages_per_sequence * page_size
    h, w = pl.program_id(0), pl.program_id(1)
    items, head_groups = pl.num_programs(1), pl.num_programs(0)
    count = count_ref[w]

    def item_range(item: jax.Array) -> _Range:
        """The positions work item ``item`` reads (module doc)."""
        seq = sequence_ref[item]
        span = _span(lengths_ref[seq], starts_ref[seq + 1], first_ref[item], count_ref[item],
                     spec.window, block_kv, max_len)  # fmt: skip
        return _Range(seq, *span)

    def copies(r: _Range, group: jax.Array, block: jax.Array, slot: jax.Array, act) -> None:
        """``act`` on the copies of kv head group ``group``'s block ``block`` of item range
        ``r``: its pages that hold a position in ``[r.lo, r.hi]``, each one copy of all the
        group's heads (and int8 scales: the block)."""
        kv = pl.ds(pl.multiple_of(group * heads, heads), heads)
        for k in range(pages_per_block):
            j = block * pages_per_block + k

            @pl.when((j * page_size <= r.hi) & ((j + 1) * page_size > r.lo))
            def _page(k: int = k, j: jax.Array = j) -> None:
                column = jnp.minimum(j, pages_per_sequence - 1)
                page = jnp.clip(table_ref[r.seq * pages_per_sequence + column], 0, num_pages - 1)
                rows = pl.ds(k * page_size, page_size)
                for a, (src, dst) in enumerate(zip(cache[:2], buffers[:2], strict=True)):
                    act(pltpu.make_async_copy(src.at[page, kv], dst.at[slot, :, rows],
                                              sems.at[slot, a]))  # fmt: skip

        # int8 scales: the block's positions of the sequence's gathered scales at once
        start = pl.multiple_of(block * block_kv, block_kv)
        for a in range(2, arrays):
            src = cache[a].at[r.seq, kv, pl.ds(start, block_kv)]
            act(pltpu.make_async_copy(src, buffers[a].at[slot], sems.at[slot, a]))

    @pl.when((h == 0) & (w == 0))
    def _first_step() -> None:  # the used items come first: item 0 is used if any is
        folded[0] = 0

        @pl.when(count > 0)
        def _start_first() -> None:
            r = item_range(0)
            copies(r, 0, r.first_block, 0, lambda c: c.start())

    @pl.when(count == 0)
    def _unused() -> None:
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(count > 0)
    def _item() -> None:
        r = item_range(w)
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
        l_ref[...] = jnp.zeros(l_ref.shape, _F32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)
        rows = q_ref.shape[1]
        q_pos = r.p0 + (lax.broadcasted_iota(jnp.int32, (rows, 1), 0) & (block_q - 1))
        base = folded[0]
        # the next step that reads the cache: the next item of this head group, else item 0 of
        # the next group (unused items are the last of each group's sweep)
        same_group = (w + 1 < items) & (count_ref[jnp.minimum(w + 1, items - 1)] > 0)
        next_group = jnp.where(same_group, h, h + 1)
        next_item = jnp.where(same_group, w + 1, 0)

        def body(i: jax.Array, carry: None) -> None:
            block, slot = r.first_block + i, (base + i) & 1
            copies(r, h, block, slot, lambda c: c.wait())

            @pl.when(i + 1 < r.blocks)
            def _start_next() -> None:
                copies(r, h, block + 1, 1 - slot, lambda c: c.start())

            @pl.when((i + 1 == r.blocks) & (next_group < head_groups))
            def _start_next_item() -> None:
                after = item_range(next_item)
                copies(after, next_group, after.first_block, 1 - slot, lambda c: c.start())

            first = block * block_kv
            for j in range(heads):  # each kv head of the group: its own 2-D matmuls
                views = [buffer.at[slot, j] for buffer in buffers]
                _fold(q_ref.at[j], views, m_ref.at[j], l_ref.at[j], acc_ref.at[j], q_pos,
                      first, r.lo, r.hi, spec)  # fmt: skip
            return carry

        lax.fori_loop(0, r.blocks, body, None)
        folded[0] = base + r.blocks
        for j in range(heads):
            sinks = None if sinks_ref is None else sinks_ref.at[j]
            _finish(sinks, m_ref.at[j], l_ref.at[j], acc_ref.at[j], o_ref.at[j])


def _span(
    length: jax.Array,
    query_end: jax.Array,
    first: jax.Array,
    count: jax.Array,
    window: int | None,
    block_kv: int,
    max_len: int,
) -> tuple[jax.Array, ...]:
    """``(p0, lo, hi, first_block, blocks)`` of `_Range` for a work item of ``count`` tokens
    from row ``first`` of a sequence of ``length`` positions whose new tokens end at row
    ``query_end``; scalars in the kernel, ``[items]`` arrays in `loop_runs`."""
    length = jnp.clip(length, 0, max_len)
    p0 = length - query_end + first  # the first token's position
    hi = jnp.minimum(p0 + count - 1, length - 1)  # the last position any row sees
    lo = jnp.zeros_like(p0) if window is None else jnp.maximum(p0 - window, 0)
    # lax.div, not //: Mosaic lowers a signed // or % through `sign`, which asks the default
    # device for the TPU's generation (an AOT compile on a CPU host has none)
    first_block = lax.div(lo, jnp.int32(block_kv)) if window is not None else jnp.zeros_like(p0)
    last_block = lax.div(jnp.maximum(hi, 0), jnp.int32(block_kv))
    # at least one block, all masked where hi < lo (lengths below the new tokens, traced)
    blocks = jnp.maximum(last_block - first_block + 1, 1)
    return p0, lo, hi, first_block, blocks


class _Range(NamedTuple):
    """The positions one work item reads: its sequence, its first token's position ``p0``,
    the positions ``[lo, hi]`` some row sees, and the kv blocks that hold them (at least 1)."""

    seq: jax.Array
    p0: jax.Array
    lo: jax.Array
    hi: jax.Array
    first_block: jax.Array
    blocks: jax.Array


def _fold(q_ref, views, m_ref, l_ref, acc_ref, q_pos, first, lo, hi, spec: RaggedSpec) -> None:
    """Folds one kv block (``views``: k, v ``[block_kv, head_dim]`` and, for int8, their
    scales ``[block_kv]``) at position ``first`` into the running max, sum and accumulator.
    ``q_pos [rows, 1]``: each row's position; ``[lo, hi]``: the positions any row sees."""
    q = q_ref[...]
    dtype = q.dtype
    precision = lax.Precision.HIGHEST if dtype == _F32 else None
    k_view, v_view = views[0], views[1]
    block_kv = k_view.shape[0]
    k = k_view[...].astype(dtype)
    scores = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=_F32, precision=precision
    )  # [rows, block_kv]
    kv_pos = first + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
    seen = (kv_pos >= lo) & (kv_pos <= hi)  # [1, block_kv]: held by a copied page
    if len(views) == 4:
        scores = scores * views[2][...].reshape(1, block_kv)
    scores = apply_softcap(scores * spec.sm_scale, spec.softcap)
    visible = seen & (kv_pos <= q_pos)
    if spec.window is not None:
        visible = visible & (kv_pos >= q_pos - spec.window)
    scores = jnp.where(visible, scores, -jnp.inf)
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row that has seen nothing yet
    p = jnp.exp(scores - m_safe[:, :1])
    alpha = jnp.exp(m_prev - m_safe)
    m_ref[...] = m_next
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    if len(views) == 4:
        v_scales = views[3][...].reshape(1, block_kv)
        p = p * jnp.where(seen, v_scales, 0.0)
        v = v_view[...].astype(dtype)
    else:
        seen_rows = (first + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0) >= lo) & (
            first + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0) <= hi
        )
        v = jnp.where(seen_rows, v_view[...], jnp.zeros((), v_view.dtype)).astype(dtype)
    pv = lax.dot_general(
        p.astype(dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=_F32,
        precision=precision,
    )  # fmt: skip
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv


def _finish(sinks_ref, m_ref, l_ref, acc_ref, o_ref) -> None:
    """Writes the normalised output, each row's sink (if any) in its denominator; a row that
    saw nothing gives zeros."""
    m, total, acc = m_ref[...][:, :1], l_ref[...][:, :1], acc_ref[...]
    if sinks_ref is not None:
        sink = sinks_ref[...][:, :1]
        m_final = jnp.maximum(m, sink)
        rescale = jnp.exp(m - m_final)
        total = total * rescale + jnp.exp(sink - m_final)
        acc = acc * rescale
    inverse = jnp.where(total > 0.0, 1.0 / jnp.where(total > 0.0, total, 1.0), 0.0)
    o_ref[...] = (acc * inverse).astype(o_ref.dtype)


def _scales_by_sequence(scales: jax.Array, page_table: jax.Array, columns: int) -> jax.Array:
    """Scales ``[num_pages, kv_heads, page_size]`` per sequence: ``[seqs, kv_heads, columns x
    page_size]`` through the page table (entries clipped into the pool), padded with page 0
    to ``columns`` pages. A page's scales of one kv head (64 bytes at 16 positions) are too
    short for a DMA (Mosaic wants 512-byte runs), a kv block's of one sequence are not; this
    gather reads ``seqs x pages_per_sequence`` pages' scales, 1/32 of their int8 K or V at
    head_dim 128."""
    num_pages, kv_heads, page_size = scales.shape
    seqs, pages_per_sequence = page_table.shape
    table = jnp.clip(page_table, 0, num_pages - 1)
    table = jnp.pad(table, ((0, 0), (0, columns - pages_per_sequence)))
    by_sequence = scales[table]  # [seqs, columns, kv_heads, page_size]
    return by_sequence.transpose(0, 2, 1, 3).reshape(seqs, kv_heads, columns * page_size)


def _ragged_kernel(
    q: jax.Array,
    cache: DecodeCache,
    query_starts: jax.Array,
    kv_lengths: jax.Array,
    sinks: jax.Array | None,
    *,
    spec: RaggedSpec,
    blocks: RaggedBlocks,
    interpret: pltpu.InterpretParams | bool | None,
) -> jax.Array:
    """`ragged_attention` with the interpreter's settings, or None for Mosaic: one kernel call
    per `ragged_blocks.kernel_calls` (the decoding sequences', the others'), their outputs
    per token merged."""
    tokens, q_heads, _ = q.shape
    num_pages, kv_heads, page_size, _ = cache.k.shape
    pages_per_sequence = cache.page_table.shape[1]
    per_block = blocks.pages_for(page_size, pages_per_sequence)
    heads = blocks.heads_for(kv_heads)
    arrays = [cache.k, cache.v]
    if cache.quantized:
        columns = -(-pages_per_sequence // per_block) * per_block
        arrays += [_scales_by_sequence(x, cache.page_table, columns)
                   for x in (cache.k_scales, cache.v_scales)]  # fmt: skip
    out = jnp.zeros_like(q)
    for call in ragged_blocks.kernel_calls(query_starts, tokens, q_heads // kv_heads, blocks):
        plan = ragged_blocks.schedule(query_starts, call.block_q, call.items, call.include)
        prefetch = [kv_lengths, query_starts, cache.page_table.reshape(-1), *plan]
        q_items = ragged_blocks.gather_queries(q, plan, kv_heads, call.block_q)
        got = _call(q_items, prefetch, arrays, sinks, spec, call, per_block, heads,
                    pages_per_sequence, num_pages, interpret)  # fmt: skip
        got = ragged_blocks.outputs_per_token(
            got, query_starts, kv_lengths, tokens, call.block_q, call.include
        )
        out = got if call.include is None else out + got  # each token in one call, 0 elsewhere
    return out


def _call(
    q_items: jax.Array,
    prefetch: list[jax.Array],
    arrays: list[jax.Array],
    sinks: jax.Array | None,
    spec: RaggedSpec,
    call: ragged_blocks.KernelCall,
    per_block: int,
    heads: int,
    pages_per_sequence: int,
    num_pages: int,
    interpret: pltpu.InterpretParams | bool | None,
) -> jax.Array:
    """One `pallas_call` of the kernel over ``q_items [items, kv_heads, rows, head_dim]``,
    ``heads`` kv heads a grid step: its output in the same layout."""
    items, kv_heads, rows, head_dim = q_items.shape
    group = rows // call.block_q
    block = (None, heads, rows, head_dim)
    inputs, in_specs = [q_items], [pl.BlockSpec(block, lambda h, w, *refs: (w, h, 0, 0))]
    if sinks is not None:
        per_row = jnp.repeat(sinks.astype(_F32).reshape(kv_heads, group), call.block_q, axis=1)
        inputs.append(jnp.broadcast_to(per_row[..., None], (kv_heads, rows, LANES)))
        in_specs.append(pl.BlockSpec((heads, rows, LANES), lambda h, w, *refs: (h, 0, 0)))
    block_kv = per_block * arrays[0].shape[2]
    scratch = [
        pltpu.VMEM((heads, rows, LANES), _F32),
        pltpu.VMEM((heads, rows, LANES), _F32),
        pltpu.VMEM((heads, rows, head_dim), _F32),
        *(pltpu.VMEM((2, heads, block_kv, head_dim), x.dtype) for x in arrays[:2]),
        *(pltpu.VMEM((2, heads, block_kv), _F32) for _ in arrays[2:]),
        pltpu.SemaphoreType.DMA((2, len(arrays))),
        pltpu.SMEM((1,), jnp.int32),
    ]
    body = functools.partial(
        _kernel, spec=spec, block_q=call.block_q, pages_per_block=per_block,
        pages_per_sequence=pages_per_sequence, num_pages=num_pages, quantized=len(arrays) == 4,
        has_sinks=sinks is not None,
    )  # fmt: skip
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct(q_items.shape, q_items.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(kv_heads // heads, items),
            in_specs=[*in_specs, *[pl.BlockSpec(memory_space=pl.ANY)] * len(arrays)],
            out_specs=pl.BlockSpec(block, lambda h, w, *refs: (w, h, 0, 0)),
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=False if interpret is None else interpret,
        name=call.name,
    )(*prefetch, *inputs, *arrays)


_jitted = interpret.jit_kernel(_ragged_kernel, ("spec", "blocks"), fold_vmap=False)


def ragged_attention(
    q: jax.Array,
    cache: DecodeCache,
    query_starts: jax.Array,
    kv_lengths: jax.Array,
    *,
    spec: RaggedSpec,
    blocks: RaggedBlocks,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """``pf.Backend.ragged_attention`` of validated inputs: ``[tokens, q_heads, head_dim]`` in
    q's dtype, zeros for padding rows. Runs as Mosaic or interpreted, as
    `pallas_flash.interpret` decides."""
    return _jitted(q, cache, query_starts, kv_lengths, sinks, spec=spec, blocks=blocks)


def loop_runs(
    query_starts: jax.Array,
    kv_lengths: jax.Array,
    *,
    kernel: str,
    tokens: int,
    q_heads: int,
    kv_heads: int,
    page_size: int,
    pages_per_sequence: int,
    spec: RaggedSpec,
    blocks: RaggedBlocks,
) -> int:
    """How often the loop over kv blocks of the call named ``kernel`` (`ragged_blocks.
    KERNEL_NAME` or `ragged_blocks.DECODE_KERNEL_NAME`) runs over its whole grid on a batch:
    every used work item's blocks, once per group of kv heads a grid step takes
    (`RaggedBlocks.heads_for`; 0 for a call the batch does not make).
    Its trip count is read from SMEM, so a static schedule needs it given (the bench's
    ``Subject.loop_trips``)."""
    block_kv = blocks.pages_for(page_size, pages_per_sequence) * page_size
    head_groups = kv_heads // blocks.heads_for(kv_heads)
    calls = ragged_blocks.kernel_calls(query_starts, tokens, q_heads // kv_heads, blocks)
    runs = 0
    for call in (c for c in calls if c.name == kernel):
        plan = ragged_blocks.schedule(query_starts, call.block_q, call.items, call.include)
        seq = plan.sequence
        span = _span(kv_lengths[seq], query_starts[seq + 1], plan.first, plan.count,
                     spec.window, block_kv, pages_per_sequence * page_size)  # fmt: skip
        runs += head_groups * int(jnp.sum(jnp.where(plan.count > 0, span[-1], 0)))
    return runs
