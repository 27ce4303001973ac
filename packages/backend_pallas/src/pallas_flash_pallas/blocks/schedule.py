"""Which blocks each kernel visits, and which ``(q block, kv block)`` pairs need a mask.

Causal and sliding-window attention leave many ``(q block, kv block)`` pairs entirely masked.
The forward kernel's kv grid axis therefore does not run over all kv blocks: step ``j`` of
query block ``i`` visits kv block ``first(i) + j``, for ``j < count(i)``, the contiguous range
of blocks that hold a visible key (`KvSchedule`). The axis is as long as the largest
``count``; at the steps past ``count(i)`` the kernel computes nothing and the K/V index map
stays on the last block it fetched, so the pipeline issues no DMA for them. The backward
kernel runs the other way round, over the query blocks that see each kv block (`QSchedule`).

Every function works both on Python ints (to size the grid at trace time) and on traced int32
scalars (grid indices, inside the kernel and the index maps).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import TypeAlias

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash.specs import AttentionSpec

Index: TypeAlias = int | jax.Array
"""A Python int or a traced int32 scalar."""


class BlockKind(enum.IntEnum):
    """How the kernel computes one visited ``(q block, kv block)`` pair."""

    FULL = 0
    """Every key is visible to every valid row: no mask is built."""
    MASKED = 1
    """Some key is hidden by the causal or window rule or lies past the end: masked."""
    DIAGONAL = 2
    """Causal without a window, both blocks whole, and the block's first key sits at the
    position of the query block's first row: row ``r`` of the block sees exactly its keys
    ``0..r``. Each row sub-block computes only the keys up to its last row and masks only the
    square tile on the diagonal."""


def _min(a: Index, b: Index) -> Index:
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _max(a: Index, b: Index) -> Index:
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _div(a: Index, b: int) -> Index:
    """``a // b`` for ``a >= 0``."""
    return a // b if isinstance(a, int) else lax.div(a, jnp.int32(b))


def _where(cond: bool | jax.Array, a: Index, b: Index) -> Index:
    return (a if cond else b) if isinstance(cond, bool) else jnp.where(cond, a, b)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How one call's queries and keys split into blocks, and which pairs need a mask.

    Attributes:
      spec: the call's settings (``causal``, ``window``, ``q_offset`` matter here).
      q_len: query rows.
      kv_len: keys.
      block_q: query rows per block.
      block_kv: keys per block.
    """

    spec: AttentionSpec
    q_len: int
    kv_len: int
    block_q: int
    block_kv: int

    @property
    def num_q_blocks(self) -> int:
        return math.ceil(self.q_len / self.block_q)

    @property
    def num_kv_blocks(self) -> int:
        return math.ceil(self.kv_len / self.block_kv)

    def _positions(self, i: Index) -> tuple[Index, Index]:
        """Key positions of the first and the last valid query row of block ``i``."""
        first_row = i * self.block_q
        last_row = _min(first_row + self.block_q, self.q_len) - 1
        return first_row + self.spec.q_offset, last_row + self.spec.q_offset

    def visited_pairs(self) -> list[tuple[int, int]]:
        """``(q block, kv block)`` pairs the schedule computes, for one head."""
        raise NotImplementedError

    @property
    def visited_blocks(self) -> int:
        """``(q block, kv block)`` pairs computed, for one head."""
        return len(self.visited_pairs())

    @property
    def kinds(self) -> frozenset[BlockKind]:
        """The kinds of all visited pairs: the kernel emits code only for these."""
        return frozenset(BlockKind(self.kind(i, kb)) for i, kb in self.visited_pairs())

    def kind(self, i: Index, kv_block: Index) -> Index:
        """The `BlockKind` of ``kv_block`` for query block ``i`` (a traced int32 for traced
        indices)."""
        needs_mask = self.needs_mask(i, kv_block)
        if not self.spec.causal or self.spec.window is not None:
            return _where(needs_mask, BlockKind.MASKED, BlockKind.FULL)
        first_pos, _ = self._positions(i)
        diagonal = first_pos == kv_block * self.block_kv
        if self.q_len % self.block_q:
            diagonal = diagonal & ((i + 1) * self.block_q <= self.q_len)
        if self.kv_len % self.block_kv:
            diagonal = diagonal & ((kv_block + 1) * self.block_kv <= self.kv_len)
        return _where(
            needs_mask, _where(diagonal, BlockKind.DIAGONAL, BlockKind.MASKED), BlockKind.FULL
        )

    def needs_mask(self, i: Index, kv_block: Index) -> bool | jax.Array:
        """Whether some pair of query block ``i`` and ``kv_block`` is hidden by the causal or
        window rule, or holds a key past the end of the keys or a row past the end of the
        queries.

        Segment ids are not considered: they are checked on every block.
        """
        window = self.spec.window
        partial_kv = self.kv_len % self.block_kv != 0
        partial_q = self.q_len % self.block_q != 0
        if not (self.spec.causal or window is not None or partial_kv or partial_q):
            return False
        first_pos, last_pos = self._positions(i)
        first_key = kv_block * self.block_kv
        last_key = first_key + self.block_kv - 1
        hidden = last_key > self.kv_len - 1 if partial_kv else False
        if partial_q:
            hidden = hidden | ((i + 1) * self.block_q > self.q_len)
        if self.spec.causal:
            hidden = hidden | (last_key > first_pos)
        if window is not None:
            hidden = (
                hidden | (first_key < last_pos - window[0]) | (last_key > first_pos + window[1])
            )
        return hidden


@dataclasses.dataclass(frozen=True)
class KvSchedule(Tiling):
    """The kv blocks visited by each query block of one call (the forward kernel's order)."""

    def _key_range(self, i: Index) -> tuple[Index, Index]:
        """The lowest and highest key any valid row of block ``i`` may see (empty if hi < lo)."""
        first_pos, last_pos = self._positions(i)
        window = self.spec.window
        lo = 0 if window is None else _max(first_pos - window[0], 0)
        hi = self.kv_len - 1
        if self.spec.causal:
            hi = _min(hi, last_pos)
        if window is not None:
            hi = _min(hi, last_pos + window[1])
        return lo, hi

    def first(self, i: Index) -> Index:
        """Index of the first kv block query block ``i`` visits (clamped to a valid block)."""
        lo, _ = self._key_range(i)
        return _min(_div(lo, self.block_kv), self.num_kv_blocks - 1)

    def count(self, i: Index) -> Index:
        """Number of kv blocks query block ``i`` visits (0 when its rows see no key)."""
        lo, hi = self._key_range(i)
        span = _div(_max(hi, lo), self.block_kv) - _div(lo, self.block_kv) + 1
        return _where(hi >= lo, span, 0)

    @property
    def num_steps(self) -> int:
        """Length of the kv grid axis: the most kv blocks any query block visits (at least 1)."""
        return max(1, *(self.count(i) for i in range(self.num_q_blocks)))

    def visited_pairs(self) -> list[tuple[int, int]]:
        return [
            (i, self.first(i) + j) for i in range(self.num_q_blocks) for j in range(self.count(i))
        ]

    def kv_block(self, i: Index, j: Index) -> Index:
        """The kv block held at step ``j`` of query block ``i``.

        Past ``count(i)`` this stays on the last visited block, so no new block is fetched.
        """
        last_step = _max(self.count(i) - 1, 0)
        return _min(self.first(i) + _min(j, last_step), self.num_kv_blocks - 1)

    def step_kinds(self, first: bool = False) -> frozenset[BlockKind]:
        """The kinds of the visited pairs at the first step of their query block (``first``)
        or at the later steps."""
        return frozenset(
            BlockKind(self.kind(i, self.first(i) + j))
            for i in range(self.num_q_blocks)
            for j in range(self.count(i))
            if (j == 0) == first
        )

    @property
    def visits_every_step(self) -> bool:
        """Whether every query block visits ``num_steps`` kv blocks (no step is skipped)."""
        return all(self.count(i) == self.num_steps for i in range(self.num_q_blocks))

    def is_visited(self, i: Index, j: Index) -> bool | jax.Array:
        """Whether step ``j`` of query block ``i`` computes anything."""
        return j < self.count(i)


@dataclasses.dataclass(frozen=True)
class QSchedule(Tiling):
    """The query blocks visited by each kv block of one call (the backward kernel's order).

    The query blocks may be split into chunks of ``chunk_blocks`` blocks (the backward keeps
    one chunk's query gradient in VMEM); each kv block then visits, chunk after chunk, the
    contiguous range of the chunk's query blocks whose rows see one of its keys.

    Attributes:
      chunk_blocks: query blocks per chunk; None for one chunk of all of them.
    """

    chunk_blocks: int | None = None

    @property
    def blocks_per_chunk(self) -> int:
        return self.num_q_blocks if self.chunk_blocks is None else self.chunk_blocks

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.num_q_blocks / self.blocks_per_chunk)

    def _row_range(self, kv_block: Index) -> tuple[Index, Index]:
        """The lowest and highest query row that sees a key of ``kv_block`` (empty if hi < lo)."""
        first_key = kv_block * self.block_kv
        last_key = _min(first_key + self.block_kv, self.kv_len) - 1
        window, offset = self.spec.window, self.spec.q_offset
        lo, hi = 0, self.q_len - 1
        if self.spec.causal:  # position p sees key t <= p
            lo = _max(lo, first_key - offset)
        if window is not None:  # p - left <= t <= p + right
            lo = _max(lo, first_key - window[1] - offset)
            hi = _min(hi, last_key + window[0] - offset)
        return lo, hi

    def _block_range(self, c: Index, kv_block: Index) -> tuple[Index, Index]:
        """First and last query block of chunk ``c`` that ``kv_block`` visits (empty if
        last < first)."""
        lo, hi = self._row_range(kv_block)
        chunk_first = c * self.blocks_per_chunk
        chunk_last = _min(chunk_first + self.blocks_per_chunk, self.num_q_blocks) - 1
        first = _max(_div(_max(lo, 0), self.block_q), chunk_first)
        last = _min(_div(_max(hi, 0), self.block_q), chunk_last)
        return first, _where(hi >= lo, last, first - 1)

    def first(self, c: Index, kv_block: Index) -> Index:
        """The first query block of chunk ``c`` that ``kv_block`` visits (clamped to the
        chunk)."""
        first, _ = self._block_range(c, kv_block)
        chunk_last = _min((c + 1) * self.blocks_per_chunk, self.num_q_blocks) - 1
        return _min(first, chunk_last)

    def count(self, c: Index, kv_block: Index) -> Index:
        """Number of query blocks of chunk ``c`` that ``kv_block`` visits."""
        first, last = self._block_range(c, kv_block)
        return _max(last - first + 1, 0)

    @property
    def num_steps(self) -> int:
        """Steps per kv block and query head: the most query blocks any kv block visits in
        one chunk (at least 1)."""
        return max(
            1,
            *(
                self.count(c, kb)
                for c in range(self.num_chunks)
                for kb in range(self.num_kv_blocks)
            ),
        )

    def visited_pairs(self) -> list[tuple[int, int]]:
        return [
            (self.first(c, kb) + s, kb)
            for c in range(self.num_chunks)
            for kb in range(self.num_kv_blocks)
            for s in range(self.count(c, kb))
        ]

    def q_block(self, c: Index, kv_block: Index, s: Index) -> Index:
        """The query block held at step ``s`` of ``kv_block`` in chunk ``c``.

        Past ``count`` this stays on the last visited block, so no new block is fetched.
        """
        last_step = _max(self.count(c, kv_block) - 1, 0)
        return self.first(c, kv_block) + _min(s, last_step)

    def is_visited(self, c: Index, kv_block: Index, s: Index) -> bool | jax.Array:
        """Whether step ``s`` of ``kv_block`` in chunk ``c`` computes anything."""
        return s < self.count(c, kv_block)
