"""What gets benchmarked: one attention or decode call at one shape, and the default sweeps.

Layouts are those of ``pf.attention`` (``[batch, heads, seq, head_dim]``) and ``pf.decode``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

Op = Literal["forward", "forward_backward", "decode"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One call: ``op`` at ``seq_len`` (queries = keys for attention; cached tokens for decode),
    on ``chips`` chips of the target (decode only: the cache's sequence axis split over a 1-D
    mesh of them)."""

    op: Op
    seq_len: int
    causal: bool = False
    batch: int = 1
    q_heads: int = 16
    kv_heads: int = 16
    head_dim: int = 128
    dtype: str = "bfloat16"
    chips: int = 1

    def __post_init__(self) -> None:
        if self.chips < 1 or (self.chips > 1 and self.op != "decode"):
            raise ValueError(f"chips: expected 1, or more for decode only; got {self.chips}")

    @property
    def label(self) -> str:
        heads = "" if self.q_heads == 16 == self.kv_heads else f" H{self.q_heads}/{self.kv_heads}"
        if self.op == "decode":
            chips = f" on {self.chips} chips" if self.chips > 1 else ""
            return f"decode L={self.seq_len}{heads}{chips}"
        return f"{self.op} N={self.seq_len}{' causal' if self.causal else ''}{heads}"

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize if self.dtype != "bfloat16" else 2

    @property
    def useful_flops(self) -> float:
        """Flops of the two matmuls over the scores that are not masked: causal counts half;
        the backward pass does 2.5x the forward's (five matmuls to the forward's two)."""
        if self.op == "decode":
            return 4.0 * self.batch * self.q_heads * self.seq_len * self.head_dim
        forward = 4.0 * self.batch * self.q_heads * self.seq_len**2 * self.head_dim
        if self.causal:
            forward /= 2
        return forward * (3.5 if self.op == "forward_backward" else 1.0)

    @property
    def min_hbm_bytes(self) -> float:
        """Bytes every implementation must move at least: its inputs and outputs, once."""
        q_sized = self.batch * self.q_heads * self.head_dim * self.itemsize
        kv_sized = self.batch * self.kv_heads * self.head_dim * self.itemsize
        if self.op == "decode":
            return 2 * q_sized + 2 * kv_sized * self.seq_len
        # forward: read q, k, v, write o; backward adds read q, k, v, o, do, write dq, dk, dv
        tensors = 2 if self.op == "forward" else 6
        return tensors * (q_sized + kv_sized) * self.seq_len

    @property
    def tokens(self) -> int:
        """Tokens one call processes: queries for attention, one per sequence for decode."""
        return self.batch * (1 if self.op == "decode" else self.seq_len)

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


POWERS_OF_TWO = (1024, 2048, 4096, 8192, 16384, 32768)
"""Attention lengths of the default sweep, forward and forward+backward."""

OTHER_LENGTHS = (1536, 3072, 5120, 6144, 12288, 24576, 100_000)
"""Lengths no power-of-two block divides, forward only: where a kernel's tiling leaves
partial blocks (a cliff a sweep of powers of two never shows)."""


def default_sweep(chips: int = 1) -> list[Workload]:
    """Batch 1, 16 heads, head_dim 128, bf16: attention 1k..32k (`POWERS_OF_TWO`), causal and
    not, forward and forward+backward, and forward at `OTHER_LENGTHS`; decode 1k..128k cached
    tokens, 16/16 and 32/8 heads, on one chip and, given a slice of ``chips`` > 1, from 8k on
    over all of them."""
    attention = [
        Workload(op, n, causal)
        for op in ("forward", "forward_backward")
        for n in POWERS_OF_TWO
        for causal in (False, True)
    ]
    attention += [Workload("forward", n, causal) for n in OTHER_LENGTHS for causal in (False, True)]
    decode = [
        Workload("decode", n, q_heads=q, kv_heads=kv)
        for n in (1024, 8192, 32768, 131072)
        for q, kv in ((16, 16), (32, 8))
    ]
    if chips > 1:
        decode += [
            Workload("decode", n, q_heads=q, kv_heads=kv, chips=chips)
            for n in (8192, 32768, 131072)
            for q, kv in ((16, 16), (32, 8))
        ]
    return attention + decode


def quick_sweep(chips: int = 1) -> list[Workload]:
    """A few points of the default sweep (about 20 minutes on a 2-core CPU): given a
    slice of ``chips`` > 1, decoding 128k tokens on one chip and on all of them."""
    quick = [
        Workload("forward", 1024),
        Workload("forward", 4096),
        Workload("forward", 4096, causal=True),
        Workload("forward_backward", 2048, causal=True),
        Workload("decode", 8192),
    ]
    if chips > 1:
        quick += [Workload("decode", 131072, q_heads=32, kv_heads=8, chips=n) for n in (1, chips)]
    return quick
