"""The ragged paged attention kernel: a flat batch of new tokens (decode tokens and prefill
chunks mixed) against their sequences' paged cache, float or int8.

Layouts: the query and the output as the batch holds them, ``[tokens, q_heads, head_dim]``,
seen as ``[tokens, kv_heads / H, H x group, head_dim]`` (a free reshape) and left in HBM; pages
``[num_pages, kv_heads, page_size, head_dim]``: k and v, or one packed uint32 pool of both
(`pallas_flash.kv_packing`: one copy a page, unpacked in the fold), or int8 k and v with
float32 scales, gathered per sequence before the kernel: ``[seqs, kv_heads, positions]``,
`ragged_attention`; and the flat page table, scalar-prefetched with ``kv_lengths``,
``query_starts`` and the schedule.

Grid ``(kv_heads / H,)``, ``H`` kv heads a step (`RaggedBlocks.heads_for`); each step loops
over the used work items (the count of used schedule entries prefetched: no empty step). A
schedule entry is ``count`` tokens of one sequence ``s`` at positions ``p0 .. p0 + count -
1``; an item takes ``S`` entries (``sequences``: 1, or the decode call's several decoding
sequences, a token each). Item ``w`` of step ``h`` takes its entries on kv heads ``h H`` to
``h H + H - 1`` and folds, by online softmax in float32 (`ragged_fold`), each entry's kv
blocks (``pages_per_block`` pages of those heads) that hold a position some row sees: from
``p0 - window`` (0 without a window) to ``p0 + count - 1``, no further than the sequence's
length; blocks wholly before or after that range are never copied. The entries' ``i``-th
blocks are folded together, as one dependent chain, for as many blocks as the item's longest
entry has (an entry past its last block is masked whole).

Copies, all by manual DMA:
- Queries and outputs: each entry's ``block_q / S`` token rows are copied into a buffer
  double-buffered across items (the next item's rows start when an item begins), and its
  ``count`` output rows copied back (one copy of a static size for each power of two in
  ``count``, waited for two items later),
  so no relayout of q or of the output runs around the kernel. The rows start at the entry's
  first token, or earlier where they would run past the batch (a batch of fewer tokens is
  padded to ``block_q``): rows before its first token are other tokens', computed for
  nothing and never copied back. In VMEM a kv head's rows are laid out ``[group x block_q,
  head_dim]``, row ``g x block_q + t``: token ``t`` (of entry ``t / (block_q / S)``), query
  head ``g``.
- KV blocks: one copy per page that holds a position of an entry's range, all ``H`` heads at
  once (the table's entries clipped into the pool by the caller; int8 scales one copy per
  block), into a double-buffered VMEM block (waited for once per array where all its pages
  are copied: a DMA semaphore counts bytes): block ``i + 1``'s copies start before block
  ``i`` is folded, and an item's last block starts the copies of the next step's first block
  (the next item of the heads, else item 0 of the next ``H``: the grid runs in order, an SMEM
  count of folded blocks carrying the buffer parity), so no step waits for its first block
  but the grid's first. A float cache's V buffers start as zeros: no stale NaN ever sits in them
  (`ragged_fold`).

All ``group`` query heads of a kv head share one ``[rows, block] @ [block, head_dim]`` matmul,
one per kv head of the step and entry (GQA reads each page once per item). Sinks join each row's
denominator at the end. Rows that see no position give zeros, and so do padding rows (the
first call's output starts as zeros).

One `kernel_call` is one call of the kernel; `pallas_flash_splitkv.ragged_attention` makes a
batch's calls.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import row_copies, tpu
from pallas_flash.kv_packing import PACKED_DTYPE
from pallas_flash.memory_space import in_hbm
from pallas_flash.specs import RaggedSpec
from pallas_flash_splitkv import ragged_blocks
from pallas_flash_splitkv.blocks import LANES
from pallas_flash_splitkv.ragged_blocks import ItemRange, item_span
from pallas_flash_splitkv.ragged_fold import BlockSpan, HeadRefs, finish_rows, fold_block

_F32 = jnp.float32


def _kernel(
    lengths_ref: jax.Ref,
    starts_ref: jax.Ref,
    table_ref: jax.Ref,
    sequence_ref: jax.Ref,
    first_ref: jax.Ref,
    count_ref: jax.Ref,
    used_ref: jax.Ref,
    q_hbm: jax.Ref,
    *refs: jax.Ref,
    spec: RaggedSpec,
    block_q: int,
    sequences: int,
    pages_per_block: int,
    pages_per_sequence: int,
    quantized: bool,
    packed: bool,
    has_sinks: bool,
) -> None:
    """One grid step ``h``: every used item ``w`` on kv heads ``h x H`` to ``h x H + H - 1``
    (module doc); item ``w`` takes the schedule's entries ``w x S`` to ``w x S + S - 1`` (``S =
    sequences``, those below the used count), each ``block_q / S`` token rows of one sequence.
    ``q_hbm`` and the output ``[tokens, kv_heads / H, H x group, head_dim]`` in HBM; refs
    after q: sinks ``[H, rows, 128]`` when given; the cache's arrays in HBM (k, v and, when
    quantized, their scales; ``packed``: the one pool of words); the output's first value
    (aliased, unread); the output; scratch: the item's query and output rows ``[2, block_q, H
    x group, head_dim]`` (double-buffered across items), the query per kv head ``[H, rows,
    head_dim]``, running max and sum ``[H, rows, 128]``, accumulator ``[H, rows, head_dim]``,
    one double-buffered block of each entry per cache array (``[2, S, H, block_kv, ...]``),
    DMA semaphores ``[2, arrays]`` and
    ``[2, 2]`` (queries, outputs), and SMEM counters: kv blocks folded, items done, and each
    output buffer's pending copies (first row and rows of each entry)."""
    sinks_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    kv_arrays = 1 if packed else 2
    arrays = 4 if quantized else kv_arrays
    cache, refs = refs[:arrays], refs[arrays + 1 :]  # the aliased first output is not read
    o_hbm, q_buf, o_buf, qs_ref, m_ref, l_ref, acc_ref = refs[:7]
    buffers, (sems, row_sems, folded, done, pending) = refs[7 : 7 + arrays], refs[7 + arrays :]
    heads = qs_ref.shape[0]
    q_per_kv = q_buf.shape[2] // heads
    tokens = q_hbm.shape[0]
    entry_rows = block_q // sequences
    page_size = buffers[0].shape[3] // pages_per_block
    block_kv = pages_per_block * page_size
    max_len = pages_per_sequence * page_size
    h, head_groups = pl.program_id(0), pl.num_programs(0)
    entries = used_ref[0]
    # lax.div, not //: Mosaic lowers a signed // through `sign` (`ragged_blocks.item_span`)
    items = lax.div(entries + sequences - 1, jnp.int32(sequences))

    def entry_range(entry: jax.Array) -> ItemRange:
        """The positions schedule entry ``entry`` reads (module doc)."""
        seq = sequence_ref[entry]
        span = item_span(lengths_ref[seq], starts_ref[seq + 1], first_ref[entry],
                         count_ref[entry], spec.window, block_kv, max_len)  # fmt: skip
        return ItemRange(seq, *span)

    def page_span(r: ItemRange, block: jax.Array) -> tuple[jax.Array | None, jax.Array]:
        """The pages ``[begin, end)`` of ``block`` (unclipped) that hold a position of item
        range ``r``, ``[r.lo, r.hi]``; ``begin`` None without a window (0)."""
        first_page = block * pages_per_block
        end = lax.div(r.hi + page_size, jnp.int32(page_size)) - first_page  # hi + 1 >= 0
        begin = None if spec.window is None else lax.div(r.lo, jnp.int32(page_size)) - first_page
        return begin, end

    def copies(r: ItemRange, head_group: jax.Array, block: jax.Array, slot: jax.Array, e: int,
               act) -> None:  # fmt: skip
        """``act`` on the copies of kv head group ``head_group``'s block ``block`` of entry
        ``e``'s range ``r``: its pages that hold a position in ``[r.lo, r.hi]``
        (`page_span`), each one copy of all the group's heads, and its int8 scales
        (`scale_copies`)."""
        kv = pl.ds(pl.multiple_of(head_group * heads, heads), heads)
        begin, end = page_span(r, block)
        row_of_sequence = r.seq * pages_per_sequence + block * pages_per_block
        for k in range(pages_per_block):
            held = k < end if begin is None else (k < end) & (k >= begin)

            @pl.when(held)
            def _page(k: int = k) -> None:
                page = table_ref[row_of_sequence + k]  # clipped into the pool before the call
                rows = pl.ds(k * page_size, page_size)
                for a, (src, dst) in enumerate(
                    zip(cache[:kv_arrays], buffers[:kv_arrays], strict=True)
                ):
                    act(pltpu.make_async_copy(src.at[page, kv], dst.at[slot, e, :, rows],
                                              sems.at[slot, a]))  # fmt: skip

        scale_copies(r, head_group, block, slot, e, act)

    def scale_copies(r: ItemRange, head_group: jax.Array, block: jax.Array, slot: jax.Array,
                     e: int, act) -> None:  # fmt: skip
        """``act`` on the copies of an int8 cache's scales for ``block`` of entry ``e``'s range
        ``r`` on kv head group ``head_group``: the block's positions of the sequence's
        gathered scales, one copy per array (none for a float cache)."""
        kv = pl.ds(pl.multiple_of(head_group * heads, heads), heads)
        start = pl.multiple_of(block * block_kv, block_kv)
        for a in range(2, arrays):
            src = cache[a].at[r.seq, kv, pl.ds(start, block_kv)]
            act(pltpu.make_async_copy(src, buffers[a].at[slot, e], sems.at[slot, a]))

    def wait_block(r: ItemRange, block: jax.Array, slot: jax.Array, e: int) -> None:
        """Waits for the copies of ``block`` of entry ``e``'s range ``r`` into buffer
        ``slot``: where every page of the block holds a position in ``[r.lo, r.hi]``, once per
        array for the whole block (a DMA semaphore counts bytes: the pages' copies together
        fill it), so no page's table entry and descriptor is made again; else `wait_pages`."""
        first_page = block * pages_per_block
        whole = ((first_page + 1) * page_size > r.lo) & (
            (first_page + pages_per_block - 1) * page_size <= r.hi
        )
        pl.when(whole)(lambda: wait_whole(slot, e))
        pl.when(jnp.logical_not(whole))(lambda: wait_pages(r, block, slot, e))

    def wait_pages(r: ItemRange, block: jax.Array, slot: jax.Array, e: int) -> None:
        """Waits for the copies of the pages of ``block`` that hold a position of ``r`` (one
        run of them, `page_span`) into entry ``e``'s buffer ``slot``: for their count, a few
        waits of static sizes (`row_copies.by_powers_of_two`; a DMA semaphore counts bytes),
        not one a page; then its scales'."""
        begin, end = page_span(r, block)
        held = jnp.clip(end, 0, pages_per_block)
        if begin is not None:
            held = jnp.maximum(held - jnp.clip(begin, 0, pages_per_block), 0)
        for a, buffer in enumerate(buffers[:kv_arrays]):

            def pages(_: jax.Array, size: int, buffer=buffer, a=a):
                # a wait counts bytes, not places: the first `size` pages' rows, at a static
                # offset (a dynamic one need not fall on a tile of an int8 buffer)
                rows = buffer.at[slot, e, :, pl.ds(0, size * page_size)]
                return pltpu.make_async_copy(rows, rows, sems.at[slot, a])

            row_copies.by_powers_of_two(held, pages_per_block, pages, lambda c: c.wait())
        scale_copies(r, h, block, slot, e, lambda c: c.wait())

    def wait_whole(slot: jax.Array, e: int) -> None:
        """Waits for every page's copies into entry ``e``'s buffer ``slot``, once per array."""
        for a, buffer in enumerate(buffers):
            whole = buffer.at[slot, e]
            pltpu.make_async_copy(whole, whole, sems.at[slot, a]).wait()

    def window_start(first: jax.Array) -> jax.Array:
        """The first of an entry's ``block_q / sequences`` token rows copied for an entry whose
        first token is row ``first``: that row, moved back where the rows would run past the
        batch (the rows before it are other tokens')."""
        return jnp.minimum(first, tokens - entry_rows)

    def query_copy(entry: jax.Array, head_group: jax.Array, slot: jax.Array, e: int):
        """The copy of schedule entry ``entry``'s query rows (`window_start`) on kv head group
        ``head_group`` into its rows of query buffer ``slot`` (the item's ``e``-th)."""
        rows = q_hbm.at[pl.ds(window_start(first_ref[entry]), entry_rows), head_group]
        dst = q_buf.at[slot, pl.ds(e * entry_rows, entry_rows)]
        return pltpu.make_async_copy(rows, dst, row_sems.at[slot, 0])

    def query_copies(item: jax.Array, head_group: jax.Array, slot: jax.Array, act) -> None:
        """``act`` on the query copies of every used entry of ``item``."""
        for e in range(sequences):
            entry = item * sequences + e
            pl.when(entry < entries)(lambda e=e, entry=entry: act(
                query_copy(entry, head_group, slot, e)))  # fmt: skip

    def output_copies(slot: jax.Array, e: int, first: jax.Array, rows: jax.Array, act) -> None:
        """``act`` on the copies of ``rows`` (1 to ``block_q / sequences``) output rows of the
        item's ``e``-th entry from buffer ``slot`` to token rows ``first`` on, on kv head
        group ``h`` (static sizes, `row_copies`)."""
        offset = e * entry_rows + first - window_start(first)

        def piece(start: jax.Array, size: int):
            src = o_buf.at[slot, pl.ds(offset + start, size)]
            dst = o_hbm.at[pl.ds(first + start, size), h]
            return pltpu.make_async_copy(src, dst, row_sems.at[slot, 1])

        row_copies.by_powers_of_two(rows, entry_rows, piece, act)

    def wait_output(slot: int | jax.Array) -> None:
        """Waits for buffer ``slot``'s output copies, if some are in flight."""
        for e in range(sequences):
            rows = pending[slot, 2 * e + 1]

            @pl.when(rows > 0)
            def _wait(e: int = e, rows: jax.Array = rows) -> None:
                output_copies(slot, e, pending[slot, 2 * e], rows, lambda c: c.wait())
                pending[slot, 2 * e + 1] = 0

    def item(w: jax.Array, carry: None) -> None:
        """Work item ``w`` on kv head group ``h`` (module doc)."""
        row_slot = done[0] & 1
        # the next step that reads the cache: the next item of this head group, else item 0 of
        # the next group
        same_group = w + 1 < items
        next_group = jnp.where(same_group, h, h + 1)
        next_item = jnp.where(same_group, w + 1, 0)
        query_copies(w, h, row_slot, lambda c: c.wait())

        @pl.when(next_group < head_groups)
        def _start_next_queries() -> None:
            query_copies(next_item, next_group, 1 - row_slot, lambda c: c.start())

        for j in range(heads):  # the rows of kv head j, query head g's first (module doc)
            rows = q_buf[row_slot, :, j * q_per_kv : (j + 1) * q_per_kv, :]
            qs_ref[j] = jnp.swapaxes(rows, 0, 1).reshape(q_per_kv * block_q, -1)
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
        l_ref[...] = jnp.zeros(l_ref.shape, _F32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)
        entry = [w * sequences + e for e in range(sequences)]
        used = [x < entries for x in entry]
        ranges = [entry_range(x) for x in entry]
        # row t of an entry's copied rows is token window_start + t, at position p0 + t - offset
        token = lax.broadcasted_iota(jnp.int32, (q_per_kv * block_q, 1), 0) & (block_q - 1)
        sequence_of_row = None if sequences == 1 else lax.div(token, jnp.int32(entry_rows))
        q_pos = None
        for e in reversed(range(sequences)):
            first = first_ref[entry[e]]
            pos = ranges[e].p0 - (first - window_start(first)) + (token & (entry_rows - 1))
            q_pos = pos if q_pos is None else jnp.where(sequence_of_row == e, pos, q_pos)
        # an entry's blocks (none for an unused one); the item's: the most of its entries'
        blocks = [jnp.where(u, r.blocks, 0) for u, r in zip(used, ranges, strict=True)]
        item_blocks = functools.reduce(jnp.maximum, blocks)
        if sequences == 1:
            head, whole = ranges[0].head, ranges[0].whole
        else:  # whole for every entry: from the first block, where no entry has a head
            head = jnp.int32(0)
            whole = functools.reduce(jnp.minimum, [
                jnp.where(u & (r.head == 0), r.whole, jnp.where(u, 0, max_len))
                for u, r in zip(used, ranges, strict=True)
            ])  # fmt: skip
        base = folded[0]
        after = [entry_range(next_item * sequences + e) for e in range(sequences)]

        def body(i: jax.Array, carry: None, masked: bool) -> None:
            slot = (base + i) & 1
            for e, r in enumerate(ranges):
                if masked:
                    pl.when(i < blocks[e])(lambda e=e, r=r: wait_block(r, r.first_block + i,
                                                                       slot, e))  # fmt: skip
                elif sequences == 1:  # every page of the block copied
                    wait_whole(slot, e)
                else:  # every page of a used entry's block copied
                    pl.when(used[e])(lambda e=e: wait_whole(slot, e))
            # the next block's copies: this item's, or after its last the next step's first
            # (one region whichever it is, so that no step's schedule holds both)
            last = i + 1 == item_blocks
            for e, r in enumerate(ranges):
                next_used = (next_item * sequences + e < entries) & (next_group < head_groups)
                pairs = zip(after[e], r, strict=True)
                ahead = ItemRange(*(jnp.where(last, a, b) for a, b in pairs))
                ahead_group = jnp.where(last, next_group, h)
                ahead_block = jnp.where(last, after[e].first_block, r.first_block + i + 1)

                @pl.when(jnp.where(last, next_used, i + 1 < blocks[e]))
                def _start_next(e=e, ahead=ahead, ahead_group=ahead_group,
                                ahead_block=ahead_block) -> None:  # fmt: skip
                    copies(ahead, ahead_group, ahead_block, 1 - slot, e, lambda c: c.start())

            spans = [BlockSpan((r.first_block + i) * block_kv, r.lo, r.hi) for r in ranges]
            group = [  # each kv head of the group: its own 2-D matmuls
                HeadRefs(qs_ref.at[j], [[buffer.at[slot, e, j] for buffer in buffers]
                                        for e in range(sequences)],
                         m_ref.at[j], l_ref.at[j], acc_ref.at[j])
                for j in range(heads)
            ]  # fmt: skip
            fold_block(group, q_pos, spans, sequence_of_row, spec, masked, page_size)
            return carry

        # the masked blocks before the whole ones (a window's only), the whole, the rest
        unmasked = head + whole
        if spec.window is not None and sequences == 1:
            lax.fori_loop(0, head, functools.partial(body, masked=True), None)
        lax.fori_loop(head, unmasked, functools.partial(body, masked=False), None)
        lax.fori_loop(unmasked, item_blocks, functools.partial(body, masked=True), None)
        folded[0] = base + item_blocks
        done[0] = done[0] + 1
        wait_output(row_slot)  # this buffer's copies of two items ago
        for j in range(heads):
            sinks = None if sinks_ref is None else sinks_ref.at[j]
            out = finish_rows(sinks, m_ref.at[j], l_ref.at[j], acc_ref.at[j])
            rows = jnp.swapaxes(out.reshape(q_per_kv, block_q, -1), 0, 1)
            o_buf[row_slot, :, j * q_per_kv : (j + 1) * q_per_kv, :] = rows.astype(o_buf.dtype)
        for e in range(sequences):

            @pl.when(used[e])
            def _write_back(e: int = e) -> None:
                first, count = first_ref[entry[e]], count_ref[entry[e]]
                output_copies(row_slot, e, first, count, lambda c: c.start())
                pending[row_slot, 2 * e], pending[row_slot, 2 * e + 1] = first, count

        return carry

    @pl.when(h == 0)
    def _first_step() -> None:
        folded[0], done[0] = 0, 0
        for e in range(sequences):
            pending[0, 2 * e + 1], pending[1, 2 * e + 1] = 0, 0
        if not quantized:  # no NaN in the V (or packed) buffers, ever (`ragged_fold`)
            values = buffers[kv_arrays - 1]
            values[...] = jnp.zeros(values.shape, values.dtype)

        for e in range(sequences):

            @pl.when(e < entries)
            def _start_first(e: int = e) -> None:
                r = entry_range(jnp.int32(e))
                copies(r, 0, r.first_block, 0, e, lambda c: c.start())

        query_copies(jnp.int32(0), 0, 0, lambda c: c.start())

    lax.fori_loop(0, items, item, None)

    @pl.when(h == head_groups - 1)
    def _last_step() -> None:
        wait_output(0)
        wait_output(1)


SCORE_TEMPORARIES = 3
"""``[rows, block_kv]`` float32 arrays each kv head of a grid step keeps live at once in a
fold (scores, their exponentials, the probabilities cast for the second matmul; the step's
heads are folded together, `ragged_fold.fold_block`), beside the scratch: the VMEM
estimate's temporaries (`kernel_call` asks Mosaic for a scoped-VMEM limit from it; at 4 kv
heads a step, items of 128 tokens of 4 query heads and kv blocks of 1024 positions outgrew
Mosaic's default 16 MiB)."""


def _vmem_bytes(scratch: object) -> int:
    """Bytes of one VMEM scratch buffer (0 for semaphores and SMEM)."""
    if getattr(scratch, "memory_space", None) != pltpu.VMEM:
        return 0
    return math.prod(scratch.shape) * jnp.dtype(scratch.dtype).itemsize


def kernel_call(
    q_rows: jax.Array,
    out: jax.Array,
    prefetch: list[jax.Array],
    arrays: list[jax.Array],
    sinks: jax.Array | None,
    spec: RaggedSpec,
    call: ragged_blocks.KernelCall,
    per_block: int,
    heads: int,
    pages_per_sequence: int,
    interpret: pltpu.InterpretParams | bool | None,
) -> jax.Array:
    """One `pallas_call` of the kernel over ``q_rows [tokens, kv_heads / heads, heads x group,
    head_dim]``, ``heads`` kv heads a grid step: ``out`` (same layout) with the rows of the
    call's tokens written, the others as they were."""
    _, head_groups, head_rows, head_dim = q_rows.shape
    group = head_rows // heads
    packed = arrays[0].dtype == PACKED_DTYPE
    kv_arrays = arrays[:1] if packed else arrays[:2]
    rows = group * call.block_q
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    inputs, in_specs = [q_rows], [hbm]
    if sinks is not None:
        per_row = jnp.repeat(sinks.astype(_F32).reshape(-1, group), call.block_q, axis=1)
        inputs.append(jnp.broadcast_to(per_row[..., None], (*per_row.shape, LANES)))
        in_specs.append(pl.BlockSpec((heads, rows, LANES), lambda h, *refs: (h, 0, 0)))
    block_kv = per_block * arrays[0].shape[2]
    entries = call.sequences
    row_block = (2, call.block_q, head_rows, head_dim)
    scratch = [
        pltpu.VMEM(row_block, q_rows.dtype),
        pltpu.VMEM(row_block, q_rows.dtype),
        pltpu.VMEM((heads, rows, head_dim), q_rows.dtype),
        pltpu.VMEM((heads, rows, LANES), _F32),
        pltpu.VMEM((heads, rows, LANES), _F32),
        pltpu.VMEM((heads, rows, head_dim), _F32),
        *(pltpu.VMEM((2, entries, heads, block_kv, head_dim), x.dtype) for x in kv_arrays),
        *(pltpu.VMEM((2, entries, heads, block_kv), _F32) for _ in arrays[2:]),
        pltpu.SemaphoreType.DMA((2, len(arrays))),
        pltpu.SemaphoreType.DMA((2, 2)),
        pltpu.SMEM((1,), jnp.int32),
        pltpu.SMEM((1,), jnp.int32),
        pltpu.SMEM((2, 2 * entries), jnp.int32),
    ]
    # the step's heads at once, and each entry's scores before they are chosen from
    temporaries = (SCORE_TEMPORARIES + entries - 1) * heads * rows * block_kv * 4
    sinks_block = 2 * heads * rows * LANES * 4 if sinks is not None else 0  # double-buffered
    needed = sum(_vmem_bytes(s) for s in scratch) + sinks_block + temporaries
    body = functools.partial(
        _kernel, spec=spec, block_q=call.block_q, sequences=entries, pages_per_block=per_block,
        pages_per_sequence=pages_per_sequence, quantized=len(arrays) == 4,
        packed=packed, has_sinks=sinks is not None,
    )  # fmt: skip
    aliased = len(prefetch) + len(inputs) + len(arrays)
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(head_groups,),
            in_specs=[*in_specs, *[hbm] * len(arrays), hbm],
            out_specs=hbm,
            scratch_shapes=scratch,
        ),
        input_output_aliases={aliased: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            disable_bounds_checks=True,
            vmem_limit_bytes=tpu.scoped_vmem_limit(needed, tpu.current_generation()),
        ),
        interpret=False if interpret is None else interpret,
        name=call.name,
    )(*prefetch, *inputs, *(in_hbm(x, interpret) for x in arrays), out)
