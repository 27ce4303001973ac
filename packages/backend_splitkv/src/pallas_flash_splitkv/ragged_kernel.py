"""The ragged paged attention kernel: a flat batch of new tokens (decode tokens and prefill
chunks mixed) against their sequences' paged cache, float or int8.

Layouts: the query and the output as the batch holds them, ``[tokens, q_heads, head_dim]``,
seen as ``[tokens, kv_heads / H, H x group, head_dim]`` (a free reshape) and left in HBM; pages
``[num_pages, kv_heads, page_size, head_dim]`` (int8 with float32 scales, gathered per
sequence before the kernel: ``[seqs, kv_heads, positions]``, `ragged_attention`) and the
flat page table, scalar-prefetched with ``kv_lengths``, ``query_starts`` and the schedule.

Grid ``(kv_heads / H,)``, ``H`` kv heads a step (`RaggedBlocks.heads_for`); each step loops
over the used work items (their count prefetched: no empty step). Item ``w`` of step ``h``
takes item ``w``'s ``count`` tokens of sequence ``s`` at positions ``p0 .. p0 + count -
1`` on kv heads ``h H`` to ``h H + H - 1`` and folds, by online softmax in float32
(`ragged_fold`), the kv blocks (``pages_per_block`` pages of those heads) that hold a position
some row sees: from ``p0 - window`` (0 without a window) to ``p0 + count - 1``, no further
than the sequence's length; blocks wholly before or after that range are never copied.

Copies, all by manual DMA:
- Queries and outputs: an item's ``block_q`` token rows are copied into a buffer
  double-buffered across items (the next item's rows start when an item begins), and its
  ``count`` output rows copied back (one copy of a static size for each power of two in
  ``count``, waited for two items later),
  so no relayout of q or of the output runs around the kernel. The rows start at the item's
  first token, or at ``tokens - block_q`` where ``block_q`` rows would run past the batch (a
  batch of fewer tokens is padded to ``block_q``): rows before its first token are other
  tokens', computed for nothing and never copied back. In VMEM a kv head's rows are laid out
  ``[group x block_q, head_dim]``, row ``g x block_q + t``: token ``t``, query head ``g``.
- KV blocks: one copy per page that holds a position of the item's range, all ``H`` heads at
  once (the table's entries clipped into the pool by the caller; int8 scales one copy per
  block), into a double-buffered VMEM block (waited for once per array where all its pages
  are copied: a DMA semaphore counts bytes): block ``i + 1``'s copies start before block
  ``i`` is folded, and an item's last block starts the copies of the next step's first block
  (the next item of the heads, else item 0 of the next ``H``: the grid runs in order, an SMEM
  count of folded blocks carrying the buffer parity), so no step waits for its first block
  but the grid's first. A float cache's V buffers start as zeros: no stale NaN ever sits in them
  (`ragged_fold`).

All ``group`` query heads of a kv head share one ``[rows, block] @ [block, head_dim]`` matmul,
one per kv head of the step (GQA reads each page once per item). Sinks join each row's
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
from pallas_flash.memory_space import in_hbm
from pallas_flash.specs import RaggedSpec
from pallas_flash_splitkv import ragged_blocks
from pallas_flash_splitkv.blocks import LANES
from pallas_flash_splitkv.ragged_blocks import ItemRange, item_span
from pallas_flash_splitkv.ragged_fold import HeadRefs, finish_rows, fold_block

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
    pages_per_block: int,
    pages_per_sequence: int,
    quantized: bool,
    has_sinks: bool,
) -> None:
    """One grid step ``h``: every used item ``w`` on kv heads ``h x H`` to ``h x H + H - 1`` (module
    doc). ``q_hbm`` and the output ``[tokens, kv_heads / H, H x group, head_dim]`` in HBM; refs
    after q: sinks ``[H, rows, 128]`` when given; the cache's arrays in HBM (k, v and, when
    quantized, their scales); the output's first value (aliased, unread); the output; scratch:
    the item's query and output rows ``[2, block_q, H x group, head_dim]`` (double-buffered
    across items), the query per kv head ``[H, rows, head_dim]``, running max and sum ``[H,
    rows, 128]``, accumulator ``[H, rows, head_dim]``, one double-buffered block per cache
    array (``[2, H, block_kv, ...]``), DMA semaphores ``[2, arrays]`` and ``[2, 2]`` (queries,
    outputs), and SMEM counters: kv blocks folded, items done, and each output buffer's
    pending copy (first row, rows)."""
    sinks_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    arrays = 4 if quantized else 2
    cache, refs = refs[:arrays], refs[arrays + 1 :]  # the aliased first output is not read
    o_hbm, q_buf, o_buf, qs_ref, m_ref, l_ref, acc_ref = refs[:7]
    buffers, (sems, row_sems, folded, done, pending) = refs[7 : 7 + arrays], refs[7 + arrays :]
    heads = qs_ref.shape[0]
    q_per_kv = q_buf.shape[2] // heads
    tokens = q_hbm.shape[0]
    page_size = buffers[0].shape[2] // pages_per_block
    block_kv = pages_per_block * page_size
    max_len = pages_per_sequence * page_size
    h, head_groups = pl.program_id(0), pl.num_programs(0)
    items = used_ref[0]

    def item_range(item: jax.Array) -> ItemRange:
        """The positions work item ``item`` reads (module doc)."""
        seq = sequence_ref[item]
        span = item_span(lengths_ref[seq], starts_ref[seq + 1], first_ref[item], count_ref[item],
                         spec.window, block_kv, max_len)  # fmt: skip
        return ItemRange(seq, *span)

    def page_span(r: ItemRange, block: jax.Array) -> tuple[jax.Array | None, jax.Array]:
        """The pages ``[begin, end)`` of ``block`` (unclipped) that hold a position of item
        range ``r``, ``[r.lo, r.hi]``; ``begin`` None without a window (0)."""
        first_page = block * pages_per_block
        end = lax.div(r.hi + page_size, jnp.int32(page_size)) - first_page  # hi + 1 >= 0
        begin = None if spec.window is None else lax.div(r.lo, jnp.int32(page_size)) - first_page
        return begin, end

    def copies(r: ItemRange, head_group: jax.Array, block: jax.Array, slot: jax.Array, act) -> None:
        """``act`` on the copies of kv head group ``head_group``'s block ``block`` of item
        range ``r``: its pages that hold a position in ``[r.lo, r.hi]`` (`page_span`), each
        one copy of all the group's heads, and its int8 scales (`scale_copies`)."""
        kv = pl.ds(pl.multiple_of(head_group * heads, heads), heads)
        begin, end = page_span(r, block)
        row_of_sequence = r.seq * pages_per_sequence + block * pages_per_block
        for k in range(pages_per_block):
            held = k < end if begin is None else (k < end) & (k >= begin)

            @pl.when(held)
            def _page(k: int = k) -> None:
                page = table_ref[row_of_sequence + k]  # clipped into the pool before the call
                rows = pl.ds(k * page_size, page_size)
                for a, (src, dst) in enumerate(zip(cache[:2], buffers[:2], strict=True)):
                    act(pltpu.make_async_copy(src.at[page, kv], dst.at[slot, :, rows],
                                              sems.at[slot, a]))  # fmt: skip

        scale_copies(r, head_group, block, slot, act)

    def scale_copies(r: ItemRange, head_group: jax.Array, block: jax.Array, slot: jax.Array,
                     act) -> None:  # fmt: skip
        """``act`` on the copies of an int8 cache's scales for ``block`` of item range ``r``
        on kv head group ``head_group``: the block's positions of the sequence's gathered
        scales, one copy per array (none for a float cache)."""
        kv = pl.ds(pl.multiple_of(head_group * heads, heads), heads)
        start = pl.multiple_of(block * block_kv, block_kv)
        for a in range(2, arrays):
            src = cache[a].at[r.seq, kv, pl.ds(start, block_kv)]
            act(pltpu.make_async_copy(src, buffers[a].at[slot], sems.at[slot, a]))

    def wait_block(r: ItemRange, block: jax.Array, slot: jax.Array) -> None:
        """Waits for the copies of ``block`` of item range ``r`` into buffer ``slot``: where
        every page of the block holds a position in ``[r.lo, r.hi]``, once per array for the
        whole buffer (a DMA semaphore counts bytes: the pages' copies together fill it), so
        no page's table entry and descriptor is made again; else `wait_pages`."""
        first_page = block * pages_per_block
        whole = ((first_page + 1) * page_size > r.lo) & (
            (first_page + pages_per_block - 1) * page_size <= r.hi
        )
        pl.when(whole)(lambda: wait_whole(slot))
        pl.when(jnp.logical_not(whole))(lambda: wait_pages(r, block, slot))

    def wait_pages(r: ItemRange, block: jax.Array, slot: jax.Array) -> None:
        """Waits for the copies of the pages of ``block`` that hold a position of ``r`` (one
        run of them, `page_span`) into buffer ``slot``: for their count, a few waits of static
        sizes (`row_copies.by_powers_of_two`; a DMA semaphore counts bytes), not one a page;
        then its scales'."""
        begin, end = page_span(r, block)
        held = jnp.clip(end, 0, pages_per_block)
        if begin is not None:
            held = jnp.maximum(held - jnp.clip(begin, 0, pages_per_block), 0)
        for a, buffer in enumerate(buffers[:2]):

            def pages(_: jax.Array, size: int, buffer=buffer, a=a):
                # a wait counts bytes, not places: the first `size` pages' rows, at a static
                # offset (a dynamic one need not fall on a tile of an int8 buffer)
                rows = buffer.at[slot, :, pl.ds(0, size * page_size)]
                return pltpu.make_async_copy(rows, rows, sems.at[slot, a])

            row_copies.by_powers_of_two(held, pages_per_block, pages, lambda c: c.wait())
        scale_copies(r, h, block, slot, lambda c: c.wait())

    def wait_whole(slot: jax.Array) -> None:
        """Waits for every page's copies into buffer ``slot``, once per array."""
        for a, buffer in enumerate(buffers):
            pltpu.make_async_copy(buffer.at[slot], buffer.at[slot], sems.at[slot, a]).wait()

    def window_start(first: jax.Array) -> jax.Array:
        """The first of the ``block_q`` token rows copied for an item whose first token is row
        ``first``: that row, moved back where the rows would run past the batch (the rows
        before it are other tokens')."""
        return jnp.minimum(first, tokens - block_q)

    def query_copy(item: jax.Array, head_group: jax.Array, slot: jax.Array):
        """The copy of ``item``'s ``block_q`` query rows (`window_start`) on kv head group
        ``head_group`` into query buffer ``slot``."""
        rows = q_hbm.at[pl.ds(window_start(first_ref[item]), block_q), head_group]
        return pltpu.make_async_copy(rows, q_buf.at[slot], row_sems.at[slot, 0])

    def output_copies(slot: jax.Array, first: jax.Array, rows: jax.Array, act) -> None:
        """``act`` on the copies of ``rows`` (1 to ``block_q``) output rows from buffer
        ``slot`` to token rows ``first`` on, on kv head group ``h`` (static sizes,
        `row_copies`)."""
        offset = first - window_start(first)

        def piece(start: jax.Array, size: int):
            src = o_buf.at[slot, pl.ds(offset + start, size)]
            dst = o_hbm.at[pl.ds(first + start, size), h]
            return pltpu.make_async_copy(src, dst, row_sems.at[slot, 1])

        row_copies.by_powers_of_two(rows, block_q, piece, act)

    def wait_output(slot: int | jax.Array) -> None:
        """Waits for buffer ``slot``'s output copies, if some are in flight."""
        rows = pending[slot, 1]

        @pl.when(rows > 0)
        def _wait() -> None:
            output_copies(slot, pending[slot, 0], rows, lambda c: c.wait())
            pending[slot, 1] = 0

    def item(w: jax.Array, carry: None) -> None:
        """Work item ``w`` on kv head group ``h`` (module doc)."""
        count = count_ref[w]
        r = item_range(w)
        row_slot = done[0] & 1
        # the next step that reads the cache: the next item of this head group, else item 0 of
        # the next group
        same_group = w + 1 < items
        next_group = jnp.where(same_group, h, h + 1)
        next_item = jnp.where(same_group, w + 1, 0)
        query_copy(w, h, row_slot).wait()

        @pl.when(next_group < head_groups)
        def _start_next_queries() -> None:
            query_copy(next_item, next_group, 1 - row_slot).start()

        for j in range(heads):  # the rows of kv head j, query head g's first (module doc)
            rows = q_buf[row_slot, :, j * q_per_kv : (j + 1) * q_per_kv, :]
            qs_ref[j] = jnp.swapaxes(rows, 0, 1).reshape(q_per_kv * block_q, -1)
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
        l_ref[...] = jnp.zeros(l_ref.shape, _F32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)
        # row t of the copied rows is token window_start + t, at position p0 + t - offset
        offset = first_ref[w] - window_start(first_ref[w])
        row = lax.broadcasted_iota(jnp.int32, (q_per_kv * block_q, 1), 0)
        q_pos = r.p0 - offset + (row & (block_q - 1))
        base = folded[0]
        after = item_range(next_item)

        def body(i: jax.Array, carry: None, masked: bool) -> None:
            block, slot = r.first_block + i, (base + i) & 1
            if masked:
                wait_block(r, block, slot)
            else:  # every page of the block copied
                wait_whole(slot)
            # the next block's copies: this item's, or after its last the next step's first
            # (one region whichever it is, so that no step's schedule holds both)
            last = i + 1 == r.blocks
            ahead = ItemRange(*(jnp.where(last, a, b) for a, b in zip(after, r, strict=True)))
            ahead_group = jnp.where(last, next_group, h)
            ahead_block = jnp.where(last, after.first_block, block + 1)

            @pl.when(ahead_group < head_groups)
            def _start_next() -> None:
                copies(ahead, ahead_group, ahead_block, 1 - slot, lambda c: c.start())

            first = block * block_kv
            group = [  # each kv head of the group: its own 2-D matmuls
                HeadRefs(qs_ref.at[j], [buffer.at[slot, j] for buffer in buffers], m_ref.at[j],
                         l_ref.at[j], acc_ref.at[j])
                for j in range(heads)
            ]  # fmt: skip
            fold_block(group, q_pos, first, r.lo, r.hi, spec, masked, page_size)
            return carry

        # the masked blocks before the whole ones (a window's only), the whole, the rest
        unmasked = r.head + r.whole
        if spec.window is not None:
            lax.fori_loop(0, r.head, functools.partial(body, masked=True), None)
        lax.fori_loop(r.head, unmasked, functools.partial(body, masked=False), None)
        lax.fori_loop(unmasked, r.blocks, functools.partial(body, masked=True), None)
        folded[0] = base + r.blocks
        done[0] = done[0] + 1
        wait_output(row_slot)  # this buffer's copy of two items ago
        for j in range(heads):
            sinks = None if sinks_ref is None else sinks_ref.at[j]
            out = finish_rows(sinks, m_ref.at[j], l_ref.at[j], acc_ref.at[j])
            rows = jnp.swapaxes(out.reshape(q_per_kv, block_q, -1), 0, 1)
            o_buf[row_slot, :, j * q_per_kv : (j + 1) * q_per_kv, :] = rows.astype(o_buf.dtype)
        output_copies(row_slot, first_ref[w], count, lambda c: c.start())
        pending[row_slot, 0], pending[row_slot, 1] = first_ref[w], count
        return carry

    @pl.when(h == 0)
    def _first_step() -> None:
        folded[0], done[0] = 0, 0
        pending[0, 1], pending[1, 1] = 0, 0
        if not quantized:  # no NaN in the V buffers, ever (`ragged_fold`)
            buffers[1][...] = jnp.zeros(buffers[1].shape, buffers[1].dtype)

        @pl.when(items > 0)
        def _start_first() -> None:
            r = item_range(0)
            copies(r, 0, r.first_block, 0, lambda c: c.start())
            query_copy(0, 0, 0).start()

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
    rows = group * call.block_q
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    inputs, in_specs = [q_rows], [hbm]
    if sinks is not None:
        per_row = jnp.repeat(sinks.astype(_F32).reshape(-1, group), call.block_q, axis=1)
        inputs.append(jnp.broadcast_to(per_row[..., None], (*per_row.shape, LANES)))
        in_specs.append(pl.BlockSpec((heads, rows, LANES), lambda h, *refs: (h, 0, 0)))
    block_kv = per_block * arrays[0].shape[2]
    row_block = (2, call.block_q, head_rows, head_dim)
    scratch = [
        pltpu.VMEM(row_block, q_rows.dtype),
        pltpu.VMEM(row_block, q_rows.dtype),
        pltpu.VMEM((heads, rows, head_dim), q_rows.dtype),
        pltpu.VMEM((heads, rows, LANES), _F32),
        pltpu.VMEM((heads, rows, LANES), _F32),
        pltpu.VMEM((heads, rows, head_dim), _F32),
        *(pltpu.VMEM((2, heads, block_kv, head_dim), x.dtype) for x in arrays[:2]),
        *(pltpu.VMEM((2, heads, block_kv), _F32) for _ in arrays[2:]),
        pltpu.SemaphoreType.DMA((2, len(arrays))),
        pltpu.SemaphoreType.DMA((2, 2)),
        pltpu.SMEM((1,), jnp.int32),
        pltpu.SMEM((1,), jnp.int32),
        pltpu.SMEM((2, 2), jnp.int32),
    ]
    temporaries = SCORE_TEMPORARIES * heads * rows * block_kv * 4  # the step's heads at once
    sinks_block = 2 * heads * rows * LANES * 4 if sinks is not None else 0  # double-buffered
    needed = sum(_vmem_bytes(s) for s in scratch) + sinks_block + temporaries
    body = functools.partial(
        _kernel, spec=spec, block_q=call.block_q, pages_per_block=per_block,
        pages_per_sequence=pages_per_sequence, quantized=len(arrays) == 4,
        has_sinks=sinks is not None,
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
