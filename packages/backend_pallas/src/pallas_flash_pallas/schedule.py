"""Which K/V blocks each query block visits, and which of them need a mask.

Causal and sliding-window attention leave many ``(q block, kv block)`` pairs entirely masked.
The kernel's kv grid axis therefore does not run over all kv blocks: step ``j`` of query block
``i`` visits kv block ``first(i) + j``, for ``j < count(i)``, the contiguous range of blocks
that hold a visible key. The axis is as long as the largest ``count``; at the steps past
``count(i)`` the kernel computes nothing and the K/V index map stays on the last block it
fetched, so the pipeline issues no DMA for them.

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
    """Causal, and the block's first key sits at the position of the query block's first row:
    row ``r`` of the block sees at most its keys ``0..r``, so each row sub-block computes only
    the keys up to its last row (and masks them)."""


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
class KvSchedule:
    """The kv blocks visited by each query block of one call.

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

    @property
    def visited_blocks(self) -> int:
        """``(q block, kv block)`` pairs computed, summed over the query blocks of one head."""
        return sum(self.count(i) for i in range(self.num_q_blocks))

    def kv_block(self, i: Index, j: Index) -> Index:
        """The kv block held at step ``j`` of query block ``i``.

        Past ``count(i)`` this stays on the last visited block, so no new block is fetched.
        """
        last_step = _max(self.count(i) - 1, 0)
        return _min(self.first(i) + _min(j, last_step), self.num_kv_blocks - 1)

    @property
    def visits_every_step(self) -> bool:
        """Whether every query block visits ``num_steps`` kv blocks (no step is skipped)."""
        return all(self.count(i) == self.num_steps for i in range(self.num_q_blocks))

    def is_visited(self, i: Index, j: Index) -> bool | jax.Array:
        """Whether step ``j`` of query block ``i`` computes anything."""
        return j < self.count(i)

    @property
    def kinds(self) -> frozenset[BlockKind]:
        """The kinds of all visited blocks: the kernel emits code only for these."""
        return frozenset(
            BlockKind(self.kind(i, self.kv_block(i, j)))
            for i in range(self.num_q_blocks)
            for j in range(self.count(i))
        )

    def kind(self, i: Index, kv_block: Index) -> Index:
        """The `BlockKind` of ``kv_block`` for query block ``i`` (a traced int32 for traced
        indices)."""
        needs_mask = self.needs_mask(i, kv_block)
        if not self.spec.causal:
            return _where(needs_mask, BlockKind.MASKED, BlockKind.FULL)
        first_pos, _ = self._positions(i)
        diagonal = first_pos == kv_block * self.block_kv
        return _where(
            needs_mask, _where(diagonal, BlockKind.DIAGONAL, BlockKind.MASKED), BlockKind.FULL
        )

    def needs_mask(self, i: Index, kv_block: Index) -> bool | jax.Array:
        """Whether some key of ``kv_block`` is hidden from some valid row of query block ``i``
        by the causal or window rule, or lies past the end of the keys.

        Segment ids are not considered: they are checked on every block.
        """
        window = self.spec.window
        partial_last = self.kv_len % self.block_kv != 0
        if not (self.spec.causal or window is not None or partial_last):
            return False
        first_pos, last_pos = self._positions(i)
        first_key = kv_block * self.block_kv
        last_key = first_key + self.block_kv - 1
        hidden = last_key > self.kv_len - 1 if partial_last else False
        if self.spec.causal:
            hidden = hidden | (last_key > first_pos)
        if window is not None:
            hidden = (
                hidden | (first_key < last_pos - window[0]) | (last_key > first_pos + window[1])
            )
        return hidden
