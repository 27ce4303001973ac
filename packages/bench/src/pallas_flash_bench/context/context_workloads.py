"""Context-parallel workloads: forward+backward attention of one sequence split over a v5e
slice, and the one-chip run each is held against.

The sequence is split over the slice's chips (`pallas_flash.context_layout`), K/V passed
round a ring or all gathered (the ``pallas`` backend's context parallelism). Held against a
quarter (one over the chips) of one chip's time per query-key pair: the one-chip
forward+backward at ``reference_len`` tokens scaled by the pairs, the work a perfect split
would give each chip.
"""

from __future__ import annotations

import dataclasses

from pallas_flash.context_layout import EXCHANGES, LAYOUTS, ContextExchange, ContextLayout
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.targets import TARGETS

ONE_PASS_REFERENCE_LEN = 131_072
"""The reference's length: the longest one-chip forward+backward (B=1, 16 heads of 128,
bfloat16, causal) whose backward runs in one pass, the cheapest per pair (longer ones split
it into a dk/dv and a dq pass: 262,144 tokens take 6.60 s, static, 1.26x the pairs' share of
131,072's 1.31 s). Other heads split at other lengths (32 query heads over 8: past 65,536
tokens), so a workload of those names its own."""


@dataclasses.dataclass(frozen=True)
class ContextWorkload:
    """Forward+backward attention of one sequence of ``seq_len`` tokens (``[1, heads, seq,
    head_dim]``, bfloat16) over every chip of ``target``, in ``layout``, K/V exchanged by
    ``exchange``; its reference the same attention on one chip at ``reference_len`` tokens
    (module doc)."""

    target: str
    seq_len: int
    q_heads: int = 16
    kv_heads: int = 16
    head_dim: int = 128
    causal: bool = True
    layout: ContextLayout = "zigzag"
    exchange: ContextExchange = "ring"
    reference_len: int = ONE_PASS_REFERENCE_LEN

    def __post_init__(self) -> None:
        if self.target not in TARGETS or TARGETS[self.target].chips < 2:
            raise ValueError(f"target: expected a slice of several chips, got {self.target!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {self.layout!r}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange: expected one of {EXCHANGES}, got {self.exchange!r}")

    @property
    def chips(self) -> int:
        return TARGETS[self.target].chips

    @property
    def name(self) -> str:
        heads = "" if self.q_heads == 16 == self.kv_heads else f" H{self.q_heads}/{self.kv_heads}"
        dims = f" D={self.head_dim}" if self.head_dim != 128 else ""
        mask = " causal" if self.causal else ""
        exchange = " all-gather" if self.exchange == "all_gather" else ""
        return f"N={self.seq_len:,}{mask}{heads}{dims} {self.layout}{exchange} on {self.target}"

    def attention(self, seq_len: int) -> Workload:
        """The same attention on one chip at ``seq_len`` tokens (its flops, its kernels)."""
        return Workload("forward_backward", seq_len, self.causal, q_heads=self.q_heads,
                        kv_heads=self.kv_heads, head_dim=self.head_dim)  # fmt: skip

    @property
    def pair_ratio(self) -> float:
        """The step's useful flops over the reference's (the ratio of their token pairs)."""
        return (
            self.attention(self.seq_len).useful_flops
            / self.attention(self.reference_len).useful_flops
        )

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def default_context() -> list[ContextWorkload]:
    """Causal, 16 heads of 128: 262,144 and 1,048,576 tokens on a v5e-4, K/V round a ring
    and all gathered; 1,048,576 on a v5e-16 (ring); and 1,048,576 tokens of Llama-3-8B-like
    heads (32 over 8) on a v5e-4 (ring), held against one chip at 65,536 tokens (at 131,072
    its backward splits in two: `ONE_PASS_REFERENCE_LEN`)."""
    return [
        *(ContextWorkload("v5e-4", n, exchange=e) for n in (262_144, 1_048_576)
          for e in EXCHANGES),
        ContextWorkload("v5e-16", 1_048_576),
        ContextWorkload("v5e-4", 1_048_576, q_heads=32, kv_heads=8, reference_len=65_536),
    ]  # fmt: skip


def quick_context() -> list[ContextWorkload]:
    """The quick sweep's one small row: 65,536 causal tokens on a v5e-4, held against one
    chip at 16,384 (exercises the whole path in minutes)."""
    return [ContextWorkload("v5e-4", 65_536, reference_len=16_384)]
