"""The ragged paged attention kernel: a flat batch of new tokens (decode tokens and prefill
chunks mixed) against their sequences' paged cache, float or int8.

Layouts: the query and the output as the batch holds them, ``[tokens, q_heads, head_dim]``,
seen as ``[tokens, kv_heads / H, H x group, head_dim]`` (a free reshape) and left in HBM; pages
``[num_pages, kv_heads, page_size, head_dim]``: k and v, or one packed uint32 pool of both
(`pallas_flash.kv_packing`: one copy a page, unpacked in the fold), or int8 k and v with
float32 scales, gathered per sequence before the kernel: ``[seqs, kv_heads, positions]``,
`ragged_attention`; for a packed pool whose new tokens the kernel writes, the new keys and
values packed ``[kv_heads, tokens, head_dim]``; and the flat page table (its entries clipped
into the pool by the caller), scalar-prefetched with ``kv_lengths``, ``query_starts``, the
schedule and, where the kernel writes the new tokens, each row's page
(`pallas_flash.ragged_write.token_pages`).

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
- KV blocks (`ragged_copies`): each entry's blocks into a double-buffered VMEM block, a packed
  pool's exactly and its new tokens written from there: block ``i + 1``'s copies start before
  block ``i`` is folded, and an item's last block starts the copies of the next step's first
  block (the next item of the heads, else item 0 of the next ``H``: the grid runs in order,
  an SMEM count of folded blocks carrying the buffer parity), so no step waits for its first
  block but the grid's first. A float or packed cache's V buffers start as zeros: no stale
  NaN ever sits in them (`ragged_fold`).

All ``group`` query heads of a kv head share one ``[rows, block] @ [block, head_dim]`` matmul,
one per kv head of the step and entry (GQA reads each page once per item). Sinks join each row's
denominator at the end. Rows that see no position give zeros, and so do padding rows (the
first call's output starts as zeros).

`ragged_call.kernel_call` is one call of the kernel; `pallas_flash_splitkv.ragged_attention`
makes a batch's calls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import row_copies
from pallas_flash.specs import RaggedSpec
from pallas_flash_splitkv.ragged_blocks import ItemRange, item_span
from pallas_flash_splitkv.ragged_copies import BlockCopies
from pallas_flash_splitkv.ragged_fold import BlockSpan, HeadRefs, finish_rows, fold_block

_F32 = jnp.float32


def kernel(
    lengths_ref: jax.Ref,
    starts_ref: jax.Ref,
    table_ref: jax.Ref,
    sequence_ref: jax.Ref,
    first_ref: jax.Ref,
    count_ref: jax.Ref,
    used_ref: jax.Ref,
    *refs: jax.Ref,
    spec: RaggedSpec,
    block_q: int,
    sequences: int,
    pages_per_block: int,
    pages_per_sequence: int,
    quantized: bool,
    packed: bool,
    writes: bool,
    has_sinks: bool,
) -> None:
    """One grid step ``h``: every used item ``w`` on kv heads ``h x H`` to ``h x H + H - 1``
    (module doc); item ``w`` takes the schedule's entries ``w x S`` to ``w x S + S - 1`` (``S =
    sequences``, those below the used count), each ``block_q / S`` token rows of one sequence.
    ``refs``: with ``writes`` (the kernel writes a packed pool's new tokens) each batch
    row's page ``[tokens]`` (prefetched); ``q_hbm`` ``[tokens, kv_heads / H, H x group,
    head_dim]`` in HBM; sinks ``[H, rows, 128]`` when given; the cache's arrays in HBM (k, v
    and, when quantized, their scales; ``packed``: the one pool of words); with ``writes`` the
    packed new tokens ``[kv_heads, tokens, head_dim]``; the output's first value (aliased,
    unread); the output (q's layout) and, with ``writes``, the written pool (aliased to the
    pool); scratch: the item's query and output rows ``[2, block_q, H x group, head_dim]``
    (double-buffered across items), the query per kv head ``[H, rows, head_dim]``, running
    max and sum ``[H, rows, 128]``, accumulator ``[H, rows, head_dim]``, one double-buffered
    block of each entry per cache array (``[2, S, H, block_kv, ...]``), DMA semaphores ``[2,
    arrays]`` and ``[2, 2]`` (queries, outputs), SMEM counters: kv blocks folded, items done,
    and each output buffer's pending copies (first row and rows of each entry); with
    ``writes`` the writes' DMA semaphores ``[2]``."""
    token_pages_ref, refs = (refs[0], refs[1:]) if writes else (None, refs)
    q_hbm, refs = refs[0], refs[1:]
    sinks_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    kv_arrays = 1 if packed else 2
    arrays = 4 if quantized else kv_arrays
    cache, refs = refs[:arrays], refs[arrays:]
    new_hbm, refs = (refs[0], refs[1:]) if writes else (None, refs)
    o_hbm, refs = refs[1], refs[2:]  # after the aliased first output, not read
    pool_out, refs = (refs[0], refs[1:]) if writes else (None, refs)
    q_buf, o_buf, qs_ref, m_ref, l_ref, acc_ref = refs[:6]
    buffers, refs = refs[6 : 6 + arrays], refs[6 + arrays :]
    sems, row_sems, folded, done, pending = refs[:5]
    write_sems = refs[5] if writes else None
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

    kv_copies = BlockCopies(
        lengths_ref, starts_ref, table_ref, cache, buffers, sems, spec.window, pages_per_block,
        pages_per_sequence, entry_rows, new_hbm, token_pages_ref, pool_out, write_sems,
    )  # fmt: skip

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
                    pl.when(i < blocks[e])(lambda e=e, r=r: kv_copies.wait(
                        r, h, r.first_block + i, slot, e))  # fmt: skip
                elif sequences == 1:  # every page of the block copied
                    kv_copies.wait_whole(slot, e)
                else:  # every page of a used entry's block copied
                    pl.when(used[e])(lambda e=e: kv_copies.wait_whole(slot, e))
            if writes:  # the entries' own new tokens, written from the block
                written = [
                    kv_copies.write_own(r, count_ref[entry[e]], used[e] & (i < blocks[e]), h,
                                        r.first_block + i, slot, e)
                    for e, r in enumerate(ranges)
                ]  # fmt: skip
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
                    kv_copies.start(ahead, ahead_group, ahead_block, 1 - slot, e)

            spans = [BlockSpan((r.first_block + i) * block_kv, r.lo, r.hi) for r in ranges]
            group = [  # each kv head of the group: its own 2-D matmuls
                HeadRefs(qs_ref.at[j], [[buffer.at[slot, e, j] for buffer in buffers]
                                        for e in range(sequences)],
                         m_ref.at[j], l_ref.at[j], acc_ref.at[j])
                for j in range(heads)
            ]  # fmt: skip
            fold_block(group, q_pos, spans, sequence_of_row, spec, masked, page_size,
                       exact=packed)  # fmt: skip
            if writes:  # before the buffer takes block i + 2
                for e in range(sequences):
                    kv_copies.wait_written(written[e], slot, e)
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
                kv_copies.start(r, 0, r.first_block, 0, e)

        query_copies(jnp.int32(0), 0, 0, lambda c: c.start())

    lax.fori_loop(0, items, item, None)

    @pl.when(h == head_groups - 1)
    def _last_step() -> None:
        wait_output(0)
        wait_output(1)
