"""What gets benchmarked: one attention, decode or mixed serving call at one shape (the sweeps
of them: `sweeps`).

Layouts are those of ``pf.attention`` (``[batch, heads, seq, head_dim]``) and ``pf.decode``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import numpy as np

from pallas_flash_bench.kernels import ragged_step

Op = Literal["forward", "forward_backward", "decode", "ragged"]

LENGTHS_SEED = 0
"""Seed of the ragged lengths a serving workload draws (`Workload.sequence_lengths`)."""


PAGE_COPYING_KERNELS = {
    "pallas_flash_split_kv_decode_paged": None,
    "pallas_flash_split_kv_decode_contiguous_pages": 128,
}
"""Decode kernels (splitkv's ``paged_kernel``) that copy each block by the page, only the
pages that hold a token, by name: the positions of a contiguous cache's page (None: a paged
cache's own pages)."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """One call: ``op`` at ``seq_len`` (queries = keys for attention; cached tokens for decode),
    on ``chips`` chips of the target (decode only: the cache split over a 1-D mesh of them, a
    contiguous cache along its sequence axis, a paged one along its pages).

    Decode only (serving): ``lengths=(lo, hi)`` gives each of the ``batch`` sequences its own
    length, drawn uniformly from ``[lo, hi]`` with `LENGTHS_SEED` (``seq_len``, the cache's
    capacity per sequence, at least ``hi``), or with ``even_lengths`` spread evenly over it
    (a batch whose step stands for the average step of a run that generates from ``lo`` to
    ``hi``); ``cache="paged"`` keeps the cache in pages of
    ``page_size`` positions, a pool of the pages the lengths use (rounded up to a multiple of
    ``chips``), page ``j`` of sequence ``b`` on chip ``(j + b) % chips`` as `PagedKVCache`
    allocates them; ``cache_dtype="int8"`` stores it in int8 with a float32 scale per token
    and kv head.

    Ragged (``op="ragged"``, one step of ``pf.ragged_attention``: `ragged_step`): ``batch``
    decoding sequences of ``lengths`` as above and ``prefill = (chunks, chunk)`` sequences
    prefilling ``chunk`` tokens each after ``prefill_context`` cached ones, all in a paged
    cache (``cache="paged"``) of ``seq_len`` positions per sequence, on one chip;
    ``sliding_window`` (a windowed layer's step): the positions a new token sees, its own
    included, as a model config's ``sliding_window`` and RPA v3's count them
    (``pf.ragged_attention``'s ``sliding_window`` is one less: `ragged_step.pf_window`).

    Attention only: ``v_head_dim`` gives v (and the output) a head_dim of their own, as MLA's
    128 beside q and k's 192 (None: ``head_dim``); ``bias`` adds a ``[1, q_heads, seq_len,
    seq_len]`` bias in the inputs' dtype (a relative-position bias: one per head, shared by
    the batch; a constant, not differentiated).
    """

    op: Op
    seq_len: int
    causal: bool = False
    batch: int = 1
    q_heads: int = 16
    kv_heads: int = 16
    head_dim: int = 128
    dtype: str = "bfloat16"
    chips: int = 1
    lengths: tuple[int, int] | None = None
    even_lengths: bool = False
    cache: Literal["contiguous", "paged"] = "contiguous"
    page_size: int = 128
    cache_dtype: str | None = None
    v_head_dim: int | None = None
    bias: bool = False
    prefill: tuple[int, int] | None = None
    prefill_context: int = 0
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.chips < 1 or (self.chips > 1 and self.op != "decode"):
            raise ValueError(f"chips: expected 1, or more for decode only; got {self.chips}")
        for name in ("lengths", "prefill"):
            if getattr(self, name) is not None:  # from JSON: a list
                object.__setattr__(self, name, tuple(getattr(self, name)))
        serving = (self.lengths, self.cache_dtype, self.cache != "contiguous")
        if self.op not in ("decode", "ragged") and any(serving):
            raise ValueError("lengths, cache and cache_dtype: expected for decode only")
        if self.op == "ragged":
            self._check_ragged()
        elif self.prefill is not None or self.prefill_context or self.sliding_window is not None:
            raise ValueError(
                "prefill, prefill_context and sliding_window: expected for ragged only"
            )
        if self.op in ("decode", "ragged") and (self.v_head_dim is not None or self.bias):
            raise ValueError("v_head_dim and bias: expected for attention only")
        if self.lengths is not None and not 0 <= self.lengths[0] <= self.lengths[1] <= self.seq_len:
            raise ValueError(f"lengths: expected 0 <= lo <= hi <= seq_len, got {self.lengths}")
        if self.cache == "paged" and self.seq_len % self.page_size:
            raise ValueError("cache='paged': expected seq_len a multiple of page_size")

    def _check_ragged(self) -> None:
        if self.cache != "paged" or self.chips != 1 or self.cache_dtype is not None:
            raise ValueError("ragged: expected a paged floating-point cache on one chip")
        if self.prefill is None and not self.batch:
            raise ValueError("ragged: expected decoding sequences or prefill chunks")
        if self.prefill is not None and self.prefill_context + self.prefill[1] > self.seq_len:
            raise ValueError("ragged: a prefilled sequence exceeds seq_len")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window: expected at least 1, got {self.sliding_window}")

    @property
    def label(self) -> str:
        if self.op == "ragged":
            return ragged_step.label(self)
        heads = "" if self.q_heads == 16 == self.kv_heads else f" H{self.q_heads}/{self.kv_heads}"
        if self.op == "decode":
            chips = f" on {self.chips} chips" if self.chips > 1 else ""
            batch = f" B={self.batch}" if self.batch > 1 else ""
            ragged = f" lengths {self.lengths[0]}..{self.lengths[1]}" if self.lengths else ""
            paged = f" paged/{self.page_size}" if self.cache == "paged" else ""
            int8 = " int8" if self.cache_dtype == "int8" else ""
            return f"decode L={self.seq_len}{heads}{batch}{ragged}{paged}{int8}{chips}"
        dims = f"/{self.v_head_dim}" if self.v_head_dim is not None else ""
        dims = f" D={self.head_dim}{dims}" if dims or self.head_dim != 128 else ""
        bias = " bias" if self.bias else ""
        return f"{self.op} N={self.seq_len}{' causal' if self.causal else ''}{heads}{dims}{bias}"

    @property
    def value_head_dim(self) -> int:
        """v's (and the output's) head_dim."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def sequence_lengths(self) -> np.ndarray:
        """Decode: ``[batch]`` cached tokens per sequence (all ``seq_len`` unless ragged);
        ragged: ``[seqs]`` positions of every sequence once its new tokens are cached
        (`ragged_step.kv_lengths`)."""
        if self.op == "ragged":
            return ragged_step.kv_lengths(self)
        return self.drawn_lengths()

    def drawn_lengths(self) -> np.ndarray:
        """``[batch]`` lengths of the decoding sequences: ``seq_len`` each, or drawn from
        ``lengths`` (class doc)."""
        if self.lengths is None:
            return np.full(self.batch, self.seq_len, np.int64)
        lo, hi = self.lengths
        if self.even_lengths:
            return np.linspace(lo, hi, self.batch).round().astype(np.int64)
        return np.random.default_rng(LENGTHS_SEED).integers(lo, hi + 1, self.batch)

    @property
    def num_pages(self) -> int:
        """Pages of a paged cache's pool: those the lengths use, rounded up to a multiple of
        ``chips``."""
        used = int(sum(math.ceil(n / self.page_size) for n in self.sequence_lengths))
        return -(-used // self.chips) * self.chips

    @property
    def cache_bytes_per_token(self) -> int:
        """K and V bytes of one cached token, all kv heads (int8: with its two scales)."""
        if self.cache_dtype == "int8":
            return 2 * self.kv_heads * (self.head_dim + 4)
        return 2 * self.kv_heads * self.head_dim * self.itemsize

    def chip_tokens(self) -> np.ndarray:
        """Decode: ``[chips, batch]``, the cached tokens of each sequence on each chip. A
        contiguous cache gives chip ``c`` positions ``[c, c + 1) x seq_len / chips`` of every
        sequence, so ragged lengths load the first chip most; a paged one spreads each
        sequence's pages round the chips (class doc)."""
        lengths = self.sequence_lengths
        if self.cache != "paged":
            part = self.seq_len // self.chips
            return np.stack([np.clip(lengths - c * part, 0, part) for c in range(self.chips)])
        tokens = np.zeros((self.chips, self.batch), np.int64)
        for b, n in enumerate(lengths):
            for j in range(math.ceil(n / self.page_size)):
                tokens[self._chip_of_page(b, j), b] += min(self.page_size, n - j * self.page_size)
        return tokens

    def _chip_of_page(self, b: int, j: int) -> int:
        """The chip holding page ``j`` of sequence ``b`` (`PagedKVCache`'s allocation)."""
        return (j + b) % self.chips

    def chip_pages(self) -> np.ndarray:
        """Decode, paged: ``[chips, batch]``, the pages of each sequence on each chip."""
        pages = np.zeros((self.chips, self.batch), np.int64)
        for b, n in enumerate(self.sequence_lengths):
            for j in range(math.ceil(n / self.page_size)):
                pages[self._chip_of_page(b, j), b] += 1
        return pages

    @property
    def table_share(self) -> int:
        """Decode, paged: the columns of the table a chip's kernel walks,
        ``ceil(pages_per_sequence / chips)``."""
        return -(-(self.seq_len // self.page_size) // self.chips)

    @property
    def runs_conditional_kernels(self) -> bool:
        """Whether the kernels a program holds in ``conditional`` branches run for this
        workload (`hlo_ops.conditional_kernel_calls`; a static schedule cannot tell). The only
        such kernel is splitkv's second pass over a paged pool split across chips, which runs
        when a chip holds more than ``ceil(pages_per_sequence / chips)`` pages of a sequence:
        never with pages that go round the chips. Anything else counts as run."""
        if self.op != "decode" or self.cache != "paged" or self.chips == 1:
            return True
        return int(self.chip_pages().max(initial=0)) > self.table_share

    @property
    def busiest_chip(self) -> int:
        """Decode: the chip holding the most cached tokens."""
        return int(np.argmax(self.chip_tokens().sum(axis=1)))

    @property
    def busiest_chip_share(self) -> float:
        """Decode over several chips: the share of the cached tokens the busiest chip holds
        (1 / chips when balanced)."""
        if self.op != "decode" or self.chips == 1:
            return 1.0
        tokens = self.chip_tokens().sum(axis=1)
        total = float(tokens.sum())
        return float(tokens.max()) / total if total else 1.0 / self.chips

    def active_fraction(self, blocks_per_sequence: int) -> float:
        """Decode: the fraction of the busiest chip's ``batch x blocks_per_sequence`` grid
        whose block holds a cached token: blocks of ``seq_len / chips / blocks_per_sequence``
        positions of its slice of a contiguous cache; of a paged one, blocks of as many of its
        pages, the chip's share of the table (``ceil(pages_per_sequence / chips)`` columns,
        its own pages first) cut into ``blocks_per_sequence``."""
        chip = self.busiest_chip
        if self.cache == "paged":
            per_block = -(-self.table_share // blocks_per_sequence)
            active = sum(math.ceil(n / per_block) for n in self.chip_pages()[chip])
        else:
            block = math.ceil(self.seq_len // self.chips / blocks_per_sequence)
            active = sum(math.ceil(n / block) for n in self.chip_tokens()[chip])
        return active / (self.batch * blocks_per_sequence)

    def page_fraction(self, page: int) -> float:
        """Decode, by a kernel that copies only the pages holding a token: the fraction of the
        busiest chip's cache (``batch x`` its share of each sequence's positions) in those
        pages, of ``page`` positions of a contiguous cache, a paged cache's own pages."""
        chip = self.busiest_chip
        if self.cache == "paged":
            return float(self.chip_pages()[chip].sum()) / (self.batch * self.table_share)
        pages = np.ceil(self.chip_tokens()[chip] / page).sum() * page
        return float(pages) / (self.batch * (self.seq_len // self.chips))

    @property
    def ragged(self) -> bool:
        """A decode of ragged lengths: its blocks past a sequence's end hold no token."""
        return self.op == "decode" and self.lengths is not None

    def filled_fraction(self, grid: tuple[int, ...] | None) -> float | None:
        """`pallas_flash_estimate.cost.kernel_cost.Occupancy`: a ragged decode's kernel whose
        grid leads with the batch (jax-paged: ``(cores, batch, heads, blocks)``) and ends with
        each sequence's blocks, the blocks that hold a cached token (`active_fraction`); 1.0
        for its other grids; None for every other call."""
        if not self.ragged:
            return None
        if grid is not None and len(grid) >= 2 and self.batch in grid[:2]:
            return self.active_fraction(grid[-1])
        return 1.0

    def copied_fraction(self, kernel: str) -> float | None:
        """`pallas_flash_estimate.cost.kernel_cost.Occupancy`: a ragged decode's page-copying
        kernel (`PAGE_COPYING_KERNELS`) reads the pages holding a token (`page_fraction`);
        None for any other kernel or call."""
        stem = kernel.split(".")[0]
        if not self.ragged or stem not in PAGE_COPYING_KERNELS:
            return None
        return self.page_fraction(PAGE_COPYING_KERNELS[stem] or self.page_size)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize if self.dtype != "bfloat16" else 2

    @property
    def useful_flops(self) -> float:
        """Flops of the matmuls over the scores that are not masked (causal counts half): the
        forward's two (``q k^T`` over head_dim, ``p v`` over v's), the backward's five (three
        over head_dim, two over v's: 2.5x the forward's when they are equal)."""
        if self.op == "ragged":
            return ragged_step.useful_flops(self)
        if self.op == "decode":
            return 4.0 * self.q_heads * self.head_dim * float(self.sequence_lengths.sum())
        pairs = self.batch * self.q_heads * self.seq_len**2 / (2 if self.causal else 1)
        d, dv = self.head_dim, self.value_head_dim
        per_pair = 2 * (d + dv) + (2 * (3 * d + 2 * dv) if self.op == "forward_backward" else 0)
        return float(pairs * per_pair)

    @property
    def min_hbm_bytes(self) -> float:
        """Bytes every implementation must move at least: its inputs and outputs, once."""
        if self.op == "ragged":
            return ragged_step.min_hbm_bytes(self)
        q_sized = self.batch * self.q_heads * self.head_dim * self.itemsize
        if self.op == "decode":
            return 2 * q_sized + self.cache_bytes_per_token * float(self.sequence_lengths.sum())
        # forward: read q, k, v, write o; backward adds read q, k, v, o, do, write dq, dk, dv
        heads = self.batch * (self.q_heads + self.kv_heads) * self.itemsize * self.seq_len
        once = heads * (self.head_dim + self.value_head_dim)  # q and k, o and v
        # the bias where a key is visible: causal hides half of it
        bias = self.q_heads * self.seq_len**2 * self.itemsize / (2 if self.causal else 1)
        bias = bias if self.bias else 0
        return (once + bias) * (1 if self.op == "forward" else 3)

    @property
    def tokens(self) -> int:
        """Tokens one call processes: queries for attention, one per sequence for decode, the
        new tokens of a ragged step."""
        if self.op == "ragged":
            return ragged_step.tokens(self)
        return self.batch * (1 if self.op == "decode" else self.seq_len)

    def to_json(self) -> dict[str, object]:
        """The fields, those of a mixed step (`prefill`, `prefill_context`) only for one and
        ``sliding_window`` only when set: a workload's record (and cache key) is the one it had
        before those fields existed."""
        fields = dataclasses.asdict(self)
        if self.op != "ragged":
            del fields["prefill"], fields["prefill_context"]
        if self.sliding_window is None:
            del fields["sliding_window"]
        return fields
