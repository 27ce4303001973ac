"""How the ragged attention kernel tiles a flat batch: its block sizes, the schedule of query
blocks (which sequence and which token rows each grid step takes) and the cache positions and
kv blocks each of them reads (`item_span`).

A ragged batch packs the new tokens of many sequences into one axis
(`pallas_flash.ragged_batch`). The kernel loops over *work items*: item ``w`` is up to
``block_q`` consecutive tokens of one sequence (a sequence of ``n`` new tokens gives
``ceil(n / block_q)`` items, an empty one none), so every item masks one sequence's causal
range and streams only that sequence's pages. The number of items is data-dependent: the
schedule's arrays have the static bound ``ceil(tokens / block_q) + seqs`` (each sequence adds
at most one partly filled item), the used items come first, and the kernel's loop takes only
those.

A decoding sequence (one new token) fills one row of an item's ``block_q`` per query head, so
the decoding sequences get a kernel call of their own (`kernel_calls`) whose items each take
`decode_block_q` decoding sequences, the fewest that fill whole sublane tiles (``group x
decode_block_q`` rows, a multiple of 8), a row per query head of each; the other sequences
get one with items of ``block_q`` tokens of one sequence. An item of several sequences folds
a kv block of each at once (`ragged_fold.fold_block`): their dependent chains (matmul, row
max, ``exp``, matmul) are one chain, where items of one decoding sequence each would fold one
after another with rows left empty.

The schedule is computed in jax before the kernel (a few ``[items]`` int32 arrays, prefetched
into SMEM); the kernel copies each item's query rows from, and its output rows to, the batch's
own ``[tokens, q_heads, head_dim]`` layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash.ragged_batch import count_at_most, lookup, new_tokens

KERNEL_NAME = "pallas_flash_ragged_paged_attention"
DECODE_KERNEL_NAME = "pallas_flash_ragged_paged_attention_decode"
"""The kernel's names: on the batch's prefill chunks (all its sequences when it makes one
call), and on its decoding sequences."""

KV_HEADS_PER_STEP = 8
"""KV heads one grid step takes when ``kv_heads_per_step`` is automatic: each kv block's pages
are copied for all of them at once, and the step's matmuls run per head (unrolled)."""

Q_BLOCK_BYTES = 512 * 1024
"""Bytes of one work item's query rows (``block_q`` tokens x a grid step's query heads x
head_dim) at most when ``block_q`` is automatic: 2048 rows of bfloat16 at head_dim 128, which
with their output, statistics and float32 accumulator fit v5e's default scoped VMEM beside the
kv blocks (4096 rows at 32 query heads a step did not). An item re-reads its sequence's kv
blocks, so larger items read each page for more tokens (v5e, static, the prefill call's
cycles at 16 tokens an item against 64: vLLM's 512-token step 258k against 192k, its
2048-token step 564k against 416k, a 1143-token chunk at 4 query heads over 1 kv head 88k
against 57k, and 54k at 256)."""

MAX_BLOCK_Q = 128
"""Tokens per work item at most when ``block_q`` is automatic: an item's causal diagonal falls
in its masked kv blocks, folded whole, so smaller items fold fewer positions no row sees
(v5e, static, the 1143-token chunk beside 127 decodes: 45.9k cycles at 128 tokens an item,
52.1k at 256, in kv blocks of 1024 positions)."""

KV_BLOCK_POSITIONS = 1024
"""Cache positions one loop step reads per kv head when ``pages_per_block`` is automatic, at
most `KV_BLOCK_HEAD_POSITIONS` ``/ H`` at ``H`` kv heads a grid step: with head_dim 128 in
bfloat16, 256 KiB of K and 256 KiB of V a head, double-buffered in VMEM. Fewer, larger blocks
fold an item's rows fewer times (v5e, static, a 1143-token chunk at 4 query heads over 1 kv
head beside 127 decodes: the prefill call 49.3k cycles at 512 positions, 45.9k at 1024,
50.0k at 2048, in items of 128 tokens)."""

KV_BLOCK_HEAD_POSITIONS = 4096
"""Positions times kv heads of one kv block of the prefill chunks' call at most: 4 MiB of
VMEM for bfloat16 K and V of head_dim 128, double-buffered (512 positions at 8 kv heads a
step)."""

DECODE_KV_BLOCK_POSITIONS = 2048
"""The same for the decoding sequences' call when ``decode_pages_per_block`` is automatic, at
one kv head a grid step; at ``H`` heads a step, `DECODE_KV_BLOCK_HEAD_POSITIONS` ``/ H`` when
that is fewer. A decode item's rows are one token's query heads, so a kv block's work is mostly
one dependent chain (``q k^T``, its row max across lanes, ``exp``, ``p v``) whose latency the
MXU and cross-lane units set, not its size: fewer, larger blocks make fewer chains (v5e,
static, Llama-3-8B's step at one chip: the decode call's critical path 322k cycles at 512
positions, 217k at 1024, 149k at 2048, when each kv head was folded on its own)."""

DECODE_KV_BLOCK_HEAD_POSITIONS = 16384
"""Positions times kv heads times sequences of one decode item's kv blocks at most: 16 MiB of
VMEM for bfloat16 K and V of head_dim 128, double-buffered (the kernel asks Mosaic for the
scoped VMEM it needs): 2048 positions at 4 kv heads a step of items of 2 sequences."""

DECODE_ITEM_SEQUENCES = 4
"""Decoding sequences one decode work item takes when ``decode_block_q`` is automatic, where
their rows stay within `DECODE_ITEM_ROWS` (more where a tile of 8 rows needs them): an item
folds a kv block of each at once, their dependent chains one chain (v5e, static, the
1,270-token step of 127 decodes at 4 query heads over 1 kv head: the decode call's critical
path 122k cycles at one sequence an item, 79k at 2, 59k at 4, 54k at 8; its schedule 85k,
76k, 72k and 75k)."""

DECODE_ITEM_ROWS = 16
"""Query rows (sequences x group) of a decode work item at most when doubling the sequences
towards `DECODE_ITEM_SEQUENCES`: every sequence's block is multiplied by all the item's rows
(v5e, static, 87 decodes at 4 query over 4 kv heads: the decode call's schedule 152k cycles
at 8 sequences an item, 165k at 16)."""

WINDOW_BLOCK_POSITIONS = 1024
"""The fewest positions of an automatic kv block that a sliding window shrinks
(`RaggedBlocks.pages_for`): at or above an int8 cache's lane row of scales (128)."""


@dataclasses.dataclass(frozen=True)
class RaggedBlocks:
    """The ragged kernel's tiling.

    Attributes:
      block_q: tokens of one sequence per work item of the prefill chunks' call (a power of
        two, at least 8): the kernel's rows are ``block_q x group`` per kv head (its query
        heads folded in). Large items read each page for more tokens of a chunk; a chunk's
        last item may be mostly empty rows. None: the largest that keeps an item's query
        rows within `Q_BLOCK_BYTES`, 8 to `MAX_BLOCK_Q` tokens and no more than the batch's
        (`block_q_for`).
      pages_per_block: pages per kv block (one inner-loop step, copied by manual DMA, double
        buffered). None: `KV_BLOCK_POSITIONS` positions' worth (fewer at several kv heads a
        step; at least 1), at most a sequence's pages.
      decode_block_q: decoding sequences per work item of their call (a power of two), one
        token and a row per query head each. None: the least that makes whole tiles of 8
        rows (`decode_rows_for`); at ``block_q`` or more, one call takes them all.
      decode_pages_per_block: pages per kv block of the decoding sequences' call. None:
        ``pages_per_block`` where that is given, else `DECODE_KV_BLOCK_POSITIONS` positions'
        worth (fewer at several kv heads a step; at least 1), at most a sequence's pages.
      kv_heads_per_step: kv heads one grid step takes, each page copied for all of them at
        once (one DMA per page and array). None: the most that divides the kv heads, up to
        `KV_HEADS_PER_STEP` (`heads_for`).
    """

    block_q: int | None = None
    pages_per_block: int | None = None
    decode_block_q: int | None = None
    kv_heads_per_step: int | None = None
    decode_pages_per_block: int | None = None

    def __post_init__(self) -> None:
        q = self.block_q
        bad_q = isinstance(q, bool) or not isinstance(q, int) or q < 8 or q & (q - 1)
        if q is not None and bad_q:
            raise ValueError(f"RaggedBlocks.block_q must be a power of two >= 8, got {q!r}")
        for name in ("pages_per_block", "decode_pages_per_block"):
            p = getattr(self, name)
            if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p <= 0):
                raise ValueError(f"RaggedBlocks.{name} must be a positive int, got {p!r}")
        h = self.kv_heads_per_step
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h <= 0):
            raise ValueError(f"RaggedBlocks.kv_heads_per_step must be a positive int, got {h!r}")
        d = self.decode_block_q
        if d is not None and (
            isinstance(d, bool) or not isinstance(d, int) or d < 1 or d & (d - 1)
        ):
            raise ValueError(f"RaggedBlocks.decode_block_q must be a power of two, got {d!r}")

    def heads_for(self, kv_heads: int) -> int:
        """KV heads a grid step takes at ``kv_heads`` kv heads (`kv_heads_per_step`)."""
        most = KV_HEADS_PER_STEP if self.kv_heads_per_step is None else self.kv_heads_per_step
        if self.kv_heads_per_step is not None and kv_heads % most:
            raise ValueError(
                f"RaggedBlocks.kv_heads_per_step must divide the kv heads ({kv_heads}), got {most}"
            )
        return max(h for h in range(1, min(most, kv_heads) + 1) if kv_heads % h == 0)

    def block_q_for(self, step_rows: int, row_bytes: int, batch_tokens: int | None = None) -> int:
        """Tokens per work item of the prefill chunks' call when a token holds ``step_rows``
        query rows in a grid step (its kv heads' query heads) of ``row_bytes`` each
        (`block_q`), in a batch of ``batch_tokens`` rows (None: any): automatic items hold
        no more than the batch (a power of two, at least 8), so no batch of 8 tokens or
        more is padded to an item's rows, which would copy its queries."""
        if self.block_q is not None:
            return self.block_q
        tokens = 8
        while (
            tokens < MAX_BLOCK_Q
            and 2 * tokens * step_rows * row_bytes <= Q_BLOCK_BYTES
            and (batch_tokens is None or 2 * tokens <= batch_tokens)
        ):
            tokens *= 2
        return tokens

    def decode_rows_for(self, group: int) -> int:
        """Decoding sequences (a token each) per decode work item at ``group`` query heads per
        kv head: `decode_block_q`, or the least power of two whose ``group x`` it is a
        multiple of 8, doubled towards `DECODE_ITEM_SEQUENCES` while the rows stay within
        `DECODE_ITEM_ROWS`."""
        if self.decode_block_q is not None:
            return self.decode_block_q
        sequences = 1
        while (group * sequences) % 8:
            sequences *= 2
        while sequences < DECODE_ITEM_SEQUENCES and 2 * group * sequences <= DECODE_ITEM_ROWS:
            sequences *= 2
        return sequences

    def pages_for(
        self,
        page_size: int,
        pages_per_sequence: int,
        kernel: str = KERNEL_NAME,
        heads: int = 1,
        window: int | None = None,
        sequences: int = 1,
    ) -> int:
        """Pages per kv block of the call named ``kernel`` (`KERNEL_NAME` or
        `DECODE_KERNEL_NAME`) for pages of ``page_size`` positions, ``heads`` kv heads a grid
        step (`heads_for`), ``sequences`` sequences a work item (the decode call's, each with
        its own kv block). Automatic, with a sliding ``window``, no more than a quarter of
        the positions a token sees (``window + 1``, rounded up to a power of two) or
        `WINDOW_BLOCK_POSITIONS`, whichever is more: a block some row sees only part of is
        folded whole under a mask, so smaller blocks fold fewer positions outside the window,
        but each block is a dependent chain of the fold (`ragged_fold`), so more blocks make
        a longer critical path. On the decode steps of 8 query over 2 kv heads (128
        sequences of 512 to 8192 positions, pages of 16) at a window of 1024, blocks of 256,
        512 and 1024 positions put ours at 1.51x, 1.42x and 1.23x of RPA v3 under the
        schedule (calibrated) but 0.59x, 0.83x and 0.95x under the critical path; the
        prefill-heavy step (3 chunks of 640 tokens beside 128 decodes) at 1.38x, 1.33x and
        1.11x, and 0.61x, 0.78x and 0.86x (v5e, static; `pallas-flash bench --windows`)."""
        per_block = self.pages_per_block
        positions = min(KV_BLOCK_POSITIONS, KV_BLOCK_HEAD_POSITIONS // heads)
        if kernel == DECODE_KERNEL_NAME:
            per_block = self.decode_pages_per_block or per_block
            most = DECODE_KV_BLOCK_HEAD_POSITIONS // (heads * sequences)
            positions = min(DECODE_KV_BLOCK_POSITIONS, most)
        if window is not None:
            quarter = 1 << max(window.bit_length() - 2, 0)
            positions = min(positions, max(quarter, WINDOW_BLOCK_POSITIONS))
        if per_block is None:
            per_block = max(1, positions // page_size)
        return min(per_block, pages_per_sequence)


class Schedule(NamedTuple):
    """The work items of one batch, ``[items]`` int32 each (module doc).

    Attributes:
      sequence: the item's sequence (0 for the unused items past the last).
      first: its first token row in the flat batch.
      count: its number of tokens, 1 to ``block_q`` (0 for unused items).
    """

    sequence: jax.Array
    first: jax.Array
    count: jax.Array


class KernelCall(NamedTuple):
    """One kernel call of a batch (module doc).

    Attributes:
      name: the kernel's name (`KERNEL_NAME` or `DECODE_KERNEL_NAME`).
      block_q: tokens per work item.
      items: the static bound on its schedule's entries (`schedule`).
      include: ``[seqs]`` bool, the sequences it takes; None: all of them.
      sequences: schedule entries per work item, each of ``block_q / sequences`` tokens of
        its own sequence: 1, or the decode call's ``block_q`` decoding sequences.
    """

    name: str
    block_q: int
    items: int
    include: jax.Array | None
    sequences: int = 1

    @property
    def entry_tokens(self) -> int:
        """Tokens of one schedule entry: ``block_q / sequences``."""
        return self.block_q // self.sequences


def kernel_calls(
    query_starts: jax.Array,
    q: jax.Array | jax.ShapeDtypeStruct,
    kv_heads: int,
    blocks: RaggedBlocks,
) -> list[KernelCall]:
    """The kernel calls of a batch of queries ``q [tokens, q_heads, head_dim]``
    (``query_starts [seqs + 1]``) over ``kv_heads`` kv heads: the decoding sequences' and the
    others', or one for all where decode items would be no smaller. Each has the static bound
    on its schedule's entries (module doc)."""
    tokens, q_heads, head_dim = q.shape
    group = q_heads // kv_heads
    step_rows = blocks.heads_for(kv_heads) * group
    seqs = query_starts.shape[0] - 1
    decode_q = blocks.decode_rows_for(group)
    block_q = blocks.block_q_for(step_rows, head_dim * jnp.dtype(q.dtype).itemsize, tokens)
    whole = KernelCall(KERNEL_NAME, block_q, -(-tokens // block_q) + seqs, None)
    if decode_q >= block_q:
        return [whole]
    decoding = new_tokens(query_starts) == 1
    return [
        # entries in whole items (the kernel reads every entry of an item, used or not)
        KernelCall(
            DECODE_KERNEL_NAME, decode_q, -(-seqs // decode_q) * decode_q, decoding, decode_q
        ),
        whole._replace(include=~decoding),
    ]


def _items_per_sequence(
    query_starts: jax.Array, block_q: int, include: jax.Array | None = None
) -> jax.Array:
    """``[seqs]`` int32: each sequence's work items (0 for an empty one, or one not in
    ``include``)."""
    n = jnp.maximum(new_tokens(query_starts), 0)
    if include is not None:
        n = jnp.where(include, n, 0)
    return (n + block_q - 1) // block_q


def schedule(
    query_starts: jax.Array, block_q: int, items: int, include: jax.Array | None = None
) -> Schedule:
    """The work items of the batch with ``query_starts [seqs + 1]`` (of the sequences in
    ``include``, default all), padded to ``items``."""
    per_sequence = _items_per_sequence(query_starts, block_q, include)
    ends = jnp.cumsum(per_sequence, dtype=jnp.int32)
    w = jnp.arange(items, dtype=jnp.int32)
    seqs = per_sequence.shape[0]
    sequence = jnp.minimum(count_at_most(ends, w), seqs - 1)
    used = w < ends[-1]
    # the item's first row: its sequence's first row, plus block_q per item before it there
    first = lookup(query_starts[:-1] - block_q * (ends - per_sequence), sequence) + w * block_q
    count = jnp.clip(lookup(query_starts[1:], sequence) - first, 0, block_q)
    return Schedule(
        jnp.where(used, sequence, 0),
        jnp.where(used, first, 0).astype(jnp.int32),
        jnp.where(used, count, 0).astype(jnp.int32),
    )


def longest_first(plan: Schedule, kv_lengths: jax.Array) -> Schedule:
    """``plan``'s used entries ordered by their sequences' lengths (``kv_lengths [seqs]``),
    longest first (ties in batch order), the unused after them: an item of several sequences
    runs its longest entry's kv blocks, so its entries should need about as many."""
    length = jnp.where(plan.count > 0, kv_lengths[plan.sequence], -1)
    order = jnp.argsort(-length, stable=True)
    return Schedule(*(x[order] for x in plan))


def item_span(
    length: jax.Array,
    query_end: jax.Array,
    first: jax.Array,
    count: jax.Array,
    window: int | None,
    block_kv: int,
    max_len: int,
) -> tuple[jax.Array, ...]:
    """``(p0, lo, hi, first_block, blocks, head, whole)`` of `ItemRange` for a work item of
    ``count`` tokens from row ``first`` of a sequence of ``length`` positions whose new tokens
    end at row ``query_end``; scalars in the kernel, ``[items]`` arrays in
    `ragged_attention.loop_runs`."""
    length = jnp.clip(length, 0, max_len)
    p0 = length - query_end + first  # the first token's position
    hi = jnp.minimum(p0 + count - 1, length - 1)  # the last position any row sees
    lo = jnp.zeros_like(p0) if window is None else jnp.maximum(p0 - window, 0)
    # lax.div, not //: Mosaic lowers a signed // or % through `sign`, which asks the default
    # device for the TPU's generation (an AOT compile on a CPU host has none)
    div = functools.partial(lax.div, y=jnp.int32(block_kv))
    first_block = div(lo) if window is not None else jnp.zeros_like(p0)
    # at least one block, all masked where hi < lo (lengths below the new tokens, traced)
    blocks = jnp.maximum(div(jnp.maximum(hi, 0)) - first_block + 1, 1)
    # every row sees the positions from hi - window (lo without a window) to p0: the blocks
    # wholly inside them are folded unmasked
    end = div(jnp.maximum(jnp.minimum(p0, hi) + 1, 0))
    if window is None:
        return p0, lo, hi, first_block, blocks, jnp.zeros_like(p0), jnp.minimum(end, blocks)
    start = div(jnp.maximum(hi - window, 0) + block_kv - 1)
    whole = jnp.clip(end - start, 0, blocks)
    head = jnp.where(whole > 0, jnp.minimum(start - first_block, blocks - whole), 0)
    return p0, lo, hi, first_block, blocks, head, whole


class ItemRange(NamedTuple):
    """The positions one work item reads: its sequence, its first token's position ``p0``,
    the positions ``[lo, hi]`` some row sees, the kv blocks that hold them (at least 1), and
    which of those every row sees whole (every position, so no mask): the ``whole`` blocks
    after the first ``head`` ones. Without a window those are the first blocks (``head`` 0:
    positions ``0`` to ``p0``); with one, the blocks from ``hi - window`` to ``p0``, after
    the masked blocks only some rows see.
    """

    seq: jax.Array
    p0: jax.Array
    lo: jax.Array
    hi: jax.Array
    first_block: jax.Array
    blocks: jax.Array
    head: jax.Array
    whole: jax.Array
