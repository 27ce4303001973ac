"""The ragged kernel's kv block copies (`ragged_kernel`): each entry's kv blocks copied from
the paged cache into a double-buffered VMEM block by manual DMA, waited for before the block
is folded, and, for a packed pool whose new tokens the kernel writes, those tokens written
from the block into their pages.

- A float or int8 cache: one copy per page that holds a position of an entry's range, all the
  grid step's ``H`` kv heads at once (int8 scales, gathered per sequence, one copy per block);
  waited for once per array where all the block's pages are copied (a DMA semaphore counts
  bytes), else for the run of pages copied. The pages' stale rows come along: the fold masks
  them (`ragged_fold`).
- A packed pool (`pallas_flash.kv_packing`) is copied exactly, as tpu-inference's RPA v3
  copies its own: of each page only the rows of the entry's range (a 32-bit row is a sublane:
  a copy may start and end on any), whole pages by copies of a static size, the page where the
  range stops (and, with a window, where it starts) by a copy of its rows; waited for by one
  wait of the block's rows. Where the kernel writes the new tokens, the positions before the
  sequence's new tokens come from their pages and the new ones from the packed batch (one copy
  a block), so each new token is read once; each entry writes its own new tokens from the
  block that holds them into their pages (one copy a page; a page out of the pool is written
  nowhere), waited for once the block is folded, before its buffer is copied into again. A
  page's copies and writes never touch the same rows: an item reads the pool only before its
  sequence's new tokens.

The page table's entries come clipped into the pool (`ragged_attention`): a page read is
always one of the pool's; a new token is written to the page core's write takes it to
(`pallas_flash.ragged_write.token_pages`), nowhere where that is none or out of the pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import row_copies
from pallas_flash_splitkv.ragged_blocks import ItemRange

Act = Callable[[object], object]
"""What is done with a copy (`pltpu.make_async_copy`'s descriptor): ``lambda c: c.start()`` or
``lambda c: c.wait()``."""


@dataclasses.dataclass(frozen=True)
class BlockCopies:
    """One kernel call's kv block copies (module doc), over its refs.

    Attributes:
      lengths: ``[seqs]`` kv lengths (SMEM).
      starts: ``[seqs + 1]`` query starts (SMEM).
      table: the flat page table ``[seqs x pages_per_sequence]`` (SMEM), entries clipped into
        the pool.
      cache: the cache's arrays in HBM: k and v (and their gathered int8 scales), or the
        packed pool.
      buffers: each array's VMEM block, ``[2, S, H, block_kv, head_dim]`` (scales ``[2, S, H,
        block_kv]``).
      sems: DMA semaphores ``[2, arrays]``, a buffer slot's per array.
      window: the call's sliding window (None: none).
      pages_per_block: pages of a kv block.
      pages_per_sequence: the table's columns.
      entry_rows: tokens of one entry at most.
      new: the packed batch ``[kv_heads, tokens, head_dim]`` in HBM, where the kernel writes
        the new tokens (else None).
      token_pages: ``[tokens]`` (SMEM) the page each of the batch's rows is written to, -1
        for none (`pallas_flash.ragged_write.token_pages`), where it does.
      pool_out: the written pool (aliased to the packed pool), where it does.
      write_sems: DMA semaphores ``[2]`` of the writes from each buffer slot, where it does.
    """

    lengths: jax.Ref
    starts: jax.Ref
    table: jax.Ref
    cache: Sequence[jax.Ref]
    buffers: Sequence[jax.Ref]
    sems: jax.Ref
    window: int | None
    pages_per_block: int
    pages_per_sequence: int
    entry_rows: int
    new: jax.Ref | None = None
    token_pages: jax.Ref | None = None
    pool_out: jax.Ref | None = None
    write_sems: jax.Ref | None = None

    @property
    def packed(self) -> bool:
        return len(self.cache) == 1

    @property
    def heads(self) -> int:
        return self.buffers[0].shape[2]

    @property
    def page_size(self) -> int:
        return self.buffers[0].shape[3] // self.pages_per_block

    @property
    def block_kv(self) -> int:
        return self.buffers[0].shape[3]

    @property
    def max_len(self) -> int:
        return self.pages_per_sequence * self.page_size

    def _kv(self, head_group: jax.Array) -> pl.Slice:
        return pl.ds(pl.multiple_of(head_group * self.heads, self.heads), self.heads)

    def _div(self, positions: jax.Array) -> jax.Array:
        """``positions // page_size`` where exact or ``positions >= 0`` (`lax.div`: Mosaic
        lowers a signed ``//`` through `sign`, `ragged_blocks.item_span`)."""
        return lax.div(positions, jnp.int32(self.page_size))

    def start(self, r: ItemRange, head_group: jax.Array, block: jax.Array, slot: jax.Array,
              e: int) -> None:  # fmt: skip
        """Starts the copies of kv head group ``head_group``'s block ``block`` of entry ``e``'s
        range ``r`` into buffer ``slot``."""
        if self.packed:
            return self._exact(r, self._kv(head_group), block, slot, e)
        begin, end = self._page_span(r, block)
        row_of_sequence = r.seq * self.pages_per_sequence + block * self.pages_per_block
        kv, size = self._kv(head_group), self.page_size
        for k in range(self.pages_per_block):
            held = k < end if begin is None else (k < end) & (k >= begin)

            @pl.when(held)
            def _page(k: int = k) -> None:
                page = self.table[row_of_sequence + k]
                for a in range(2):
                    dst = self.buffers[a].at[slot, e, :, pl.ds(k * size, size)]
                    copy = pltpu.make_async_copy(self.cache[a].at[page, kv], dst,
                                                 self.sems.at[slot, a])  # fmt: skip
                    copy.start()

        self._scales(r, head_group, block, slot, e, lambda c: c.start())

    def wait(self, r: ItemRange, head_group: jax.Array, block: jax.Array, slot: jax.Array,
             e: int) -> None:  # fmt: skip
        """Waits for the copies of ``block`` of entry ``e``'s range ``r`` into buffer ``slot``:
        a packed pool's by one wait of its rows in ``[r.lo, r.hi]``; else where every page of
        the block holds a position in ``[r.lo, r.hi]`` once per array for the whole block
        (`wait_whole`), so no page's table entry and descriptor is made again, or for the run
        of pages copied (`_wait_pages`)."""
        if self.packed:
            start, end = block * self.block_kv, (block + 1) * self.block_kv
            rows = jnp.clip(r.hi + 1, start, end) - jnp.clip(r.lo, start, end)
            return self._wait_rows(rows, slot, e, self.sems.at[slot, 0])
        first_page = block * self.pages_per_block
        whole = ((first_page + 1) * self.page_size > r.lo) & (
            (first_page + self.pages_per_block - 1) * self.page_size <= r.hi
        )
        pl.when(whole)(lambda: self.wait_whole(slot, e))
        pl.when(jnp.logical_not(whole))(lambda: self._wait_pages(r, head_group, block, slot, e))

    def wait_whole(self, slot: jax.Array, e: int) -> None:
        """Waits for every position's copies into entry ``e``'s buffer ``slot``, once per
        array."""
        for a, buffer in enumerate(self.buffers):
            whole = buffer.at[slot, e]
            pltpu.make_async_copy(whole, whole, self.sems.at[slot, a]).wait()

    def write_own(self, r: ItemRange, count: jax.Array, live: jax.Array, head_group: jax.Array,
                  block: jax.Array, slot: jax.Array, e: int) -> jax.Array:  # fmt: skip
        """Starts the copies that write entry ``e``'s own new tokens (``count`` from position
        ``r.p0``, to ``r.hi``) held by ``block`` of buffer ``slot`` into their pages on kv
        head group ``head_group``, one a page (a page out of the pool is written nowhere, as
        core's write does), where ``live``; returns the rows they write (`wait_written`). A
        sequence whose length passes its pages (traced, unchecked) writes none."""
        page_size, block_kv = self.page_size, self.block_kv
        start = block * block_kv
        _, offset = self._new_tokens(r)
        lo = jnp.maximum(r.p0, start)
        end = jnp.minimum(jnp.minimum(r.p0 + count, r.hi + 1), start + block_kv)
        end = jnp.where(live & (self.lengths[r.seq] <= self.max_len), end, lo)
        first_column = self._div(jnp.maximum(lo, 0))
        written = jnp.int32(0)
        rows = min(self.entry_rows, block_kv)
        for k in range(min(self.pages_per_block, (rows + page_size - 2) // page_size + 1)):
            page_start = (first_column + k) * page_size
            at = jnp.maximum(lo, page_start)
            size = jnp.minimum(end, page_start + page_size) - at
            # the page of the run's first token (`offset + at` its row of the batch, in it)
            page = self.token_pages[jnp.clip(offset + at, 0, self.token_pages.shape[0] - 1)]
            size = jnp.where((page >= 0) & (page < self.cache[0].shape[0]), size, 0)

            @pl.when(size > 0)
            def _write(at=at, size=size, page=page, page_start=page_start) -> None:
                src = self.buffers[0].at[slot, e, :, pl.ds(at - start, size)]
                dst = self.pool_out.at[page, self._kv(head_group), pl.ds(at - page_start, size)]
                pltpu.make_async_copy(src, dst, self.write_sems.at[slot]).start()

            written = written + jnp.maximum(size, 0)
        return written

    def wait_written(self, rows: jax.Array, slot: jax.Array, e: int) -> None:
        """Waits for `write_own`'s ``rows`` written from entry ``e``'s buffer ``slot``."""
        self._wait_rows(rows, slot, e, self.write_sems.at[slot])

    def _new_tokens(self, r: ItemRange) -> tuple[jax.Array, jax.Array | None]:
        """``(cached, offset)`` of range ``r``'s sequence: its positions read from the pool
        (before its new tokens, or all of them where the kernel does not write them), and
        what takes a new position to its row of the batch."""
        length = jnp.clip(self.lengths[r.seq], 0, self.max_len)  # as `item_span` clips it
        if self.new is None:
            return length, None
        query_end = self.starts[r.seq + 1]
        return length - (query_end - self.starts[r.seq]), query_end - length

    def _exact(self, r: ItemRange, kv: pl.Slice, block: jax.Array, slot: jax.Array,
               e: int) -> None:  # fmt: skip
        """Starts the copies of a packed pool's ``block`` of entry ``e``'s range ``r`` on kv
        heads ``kv``: exactly its positions in ``[r.lo, r.hi]``, each to its own rows of the
        buffer (module doc)."""
        page_size, block_kv, buffer, sem = (self.page_size, self.block_kv, self.buffers[0],
                                             self.sems.at[slot, 0])  # fmt: skip
        start = block * block_kv
        cached, offset = self._new_tokens(r)
        stop = jnp.minimum(r.hi + 1, cached)  # the positions read from the pool end here
        first_whole = self._div(r.lo + page_size - 1) * page_size
        stop_page = self._div(jnp.maximum(stop, 0)) * page_size
        # the block's whole pages (page-aligned positions: exact quotients, of either sign)
        begin, end = self._div(first_whole - start), self._div(stop_page - start)
        row_of_sequence = r.seq * self.pages_per_sequence + block * self.pages_per_block
        for k in range(self.pages_per_block):
            held = k < end if self.window is None else (k >= begin) & (k < end)  # begin <= 0

            @pl.when(held)
            def _page(k: int = k) -> None:
                src = self.cache[0].at[self.table[row_of_sequence + k], kv]
                dst = buffer.at[slot, e, :, pl.ds(k * page_size, page_size)]
                pltpu.make_async_copy(src, dst, sem).start()

        def rows(lo: jax.Array, hi: jax.Array) -> None:
            """The copy of positions ``[lo, hi)``, of one page, where they lie in the block."""

            @pl.when((hi > lo) & (lo >= start) & (lo < start + block_kv))
            def _rows() -> None:
                column = self._div(lo)
                page = self.table[r.seq * self.pages_per_sequence + column]
                src = self.cache[0].at[page, kv, pl.ds(lo - column * page_size, hi - lo)]
                dst = buffer.at[slot, e, :, pl.ds(lo - start, hi - lo)]
                pltpu.make_async_copy(src, dst, sem).start()

        if self.window is not None:  # the rows from lo of its page, where lo is inside one
            rows(r.lo, jnp.minimum(first_whole, stop))
        rows(jnp.maximum(stop_page, r.lo), jnp.where(stop_page >= first_whole, stop, 0))
        if self.new is None:
            return
        lo = jnp.maximum(jnp.maximum(r.lo, cached), start)
        size = jnp.minimum(r.hi + 1, start + block_kv) - lo

        @pl.when(size > 0)
        def _new() -> None:
            src = self.new.at[kv, pl.ds(offset + lo, size)]
            dst = buffer.at[slot, e, :, pl.ds(lo - start, size)]
            pltpu.make_async_copy(src, dst, sem).start()

    def _wait_rows(self, rows: jax.Array, slot: jax.Array, e: int, sem: jax.Ref) -> None:
        """Waits on ``sem`` for copies of ``rows`` rows of entry ``e``'s packed buffer
        ``slot``, if any: one wait of that size (a DMA semaphore counts bytes)."""

        @pl.when(rows > 0)
        def _wait() -> None:
            part = self.buffers[0].at[slot, e, :, pl.ds(0, rows)]
            pltpu.make_async_copy(part, part, sem).wait()

    def _page_span(self, r: ItemRange, block: jax.Array) -> tuple[jax.Array | None, jax.Array]:
        """The pages ``[begin, end)`` of ``block`` (unclipped) that hold a position of item
        range ``r``, ``[r.lo, r.hi]``; ``begin`` None without a window (0)."""
        first_page = block * self.pages_per_block
        end = self._div(r.hi + self.page_size) - first_page  # hi + 1 >= 0
        begin = None if self.window is None else self._div(r.lo) - first_page
        return begin, end

    def _scales(self, r: ItemRange, head_group: jax.Array, block: jax.Array, slot: jax.Array,
                e: int, act: Act) -> None:  # fmt: skip
        """``act`` on the copies of an int8 cache's scales for ``block`` of entry ``e``'s range
        ``r`` on kv head group ``head_group``: the block's positions of the sequence's
        gathered scales, one copy per array (none for a float cache)."""
        start = pl.multiple_of(block * self.block_kv, self.block_kv)
        for a in range(2, len(self.cache)):
            src = self.cache[a].at[r.seq, self._kv(head_group), pl.ds(start, self.block_kv)]
            act(pltpu.make_async_copy(src, self.buffers[a].at[slot, e], self.sems.at[slot, a]))

    def _wait_pages(self, r: ItemRange, head_group: jax.Array, block: jax.Array,
                    slot: jax.Array, e: int) -> None:  # fmt: skip
        """Waits for the copies of the pages of ``block`` that hold a position of ``r`` (one
        run of them, `_page_span`) into entry ``e``'s buffer ``slot``: for their count, a few
        waits of static sizes (`row_copies.by_powers_of_two`; a DMA semaphore counts bytes),
        not one a page; then its scales'."""
        begin, end = self._page_span(r, block)
        held = jnp.clip(end, 0, self.pages_per_block)
        if begin is not None:
            held = jnp.maximum(held - jnp.clip(begin, 0, self.pages_per_block), 0)
        for a in range(2):

            def pages(_: jax.Array, size: int, buffer: jax.Ref = self.buffers[a], a: int = a):
                # a wait counts bytes, not places: the first `size` pages' rows, at a static
                # offset (a dynamic one need not fall on a tile of an int8 buffer)
                rows = buffer.at[slot, e, :, pl.ds(0, size * self.page_size)]
                return pltpu.make_async_copy(rows, rows, self.sems.at[slot, a])

            row_copies.by_powers_of_two(held, self.pages_per_block, pages, lambda c: c.wait())
        self._scales(r, head_group, block, slot, e, lambda c: c.wait())
