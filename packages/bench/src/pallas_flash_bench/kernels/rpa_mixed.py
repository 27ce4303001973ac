"""tpu-inference's Ragged Paged Attention v3 on a mixed serving step (`ragged_step`): the
reference for ``pf.ragged_attention``, in its own layout (`rpa_reference`), as vLLM calls it.

The step's decoding sequences come first: ``distribution = (decodes, decodes, sequences)``
hands them to its decode kernel (``RPAd``: one query a sequence) and the prefill chunks to its
mixed one (``RPAm``); its prefill kernel, compiled only with a static ``chunk_prefill_size``,
is not. A windowed layer's step hands it the window (``sliding_window``: the positions a token
sees, as the workload counts them), from which its loops start at the kv block of the first
visible position. ``update_kv_cache=True``: its kernels write the new tokens' keys and values
into their pages, as ``pf.ragged_attention`` does before the backend reads the cache, reading
them from ``keys``/``values`` meanwhile. Its blocks: vLLM's v5e heuristic for each kernel
(``get_default_block_sizes``) and a few others (`BLOCKS`), the VMEM limit the core's whole
VMEM, as for its decode rows.

Its loops read their trip counts from ``distribution``, ``cu_q_lens`` and ``kv_lens``
(`rpa_reference.sequence_trips` counts them as its kernel runs them, `loop_trips` gives
them to the estimate).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from pallas_flash_bench.kernels import rpa_reference
from pallas_flash_bench.kernels.rpa_reference import DecodeBlocks
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.aot.program_ref import ArraySpec


class MixedBlocks(NamedTuple):
    """The mixed kernel's query block (``bq_sz``, tokens), kv block (``bkv_sz``), query
    compute block (``bq_csz``, dividing the query block) and kv compute chunk (``bkv_csz``)."""

    q: int
    kv: int
    q_compute: int
    kv_compute: int

    @property
    def label(self) -> str:
        return f"q {self.q}/{self.q_compute} kv {self.kv}/{self.kv_compute}"


class StepBlocks(NamedTuple):
    """Its blocks on a step: the decode kernel's and the mixed kernel's, None for vLLM's
    heuristic (`rpa_reference.decode_blocks`, `rpa_reference.mixed_blocks`); ``unless``:
    blocks that take precedence, where they apply (a sweep's fallback)."""

    decode: DecodeBlocks | None
    mixed: MixedBlocks | None
    unless: StepBlocks | None = None

    @property
    def label(self) -> str:
        decode = self.decode.label if self.decode else "vLLM's"
        mixed = self.mixed.label if self.mixed else "vLLM's"
        unless = f" where {self.unless.label} does not apply" if self.unless else ""
        return f"step: decode {decode}; mixed {mixed}{unless}"

    def decode_of(self, workload: Workload) -> DecodeBlocks:
        return self.decode or rpa_reference.decode_blocks(workload)

    def mixed_of(self, workload: Workload) -> MixedBlocks:
        return self.mixed or MixedBlocks(*rpa_reference.mixed_blocks(workload))


_QUICK = StepBlocks(DecodeBlocks(2048, 1024), None)
BLOCKS = {
    "quick": [_QUICK, StepBlocks(None, None, unless=_QUICK)],
    "default": [
        StepBlocks(None, None),
        *(StepBlocks(decode, None) for decode in rpa_reference.BLOCKS["default"]),
        StepBlocks(DecodeBlocks(2048, 1024), MixedBlocks(128, 1024, 128, 512)),
    ],
}
"""Blocks to try on a step: vLLM's heuristic for both kernels; each decode block of the decode
rows' search (`rpa_reference.BLOCKS`: 1024 to 4096 tokens, computed whole or 1024 at a time)
with the heuristic's mixed blocks; and their fastest (2048, compute 1024) with mixed query
blocks of 128 tokens (the heuristic's at 32/8 heads and 512 tokens or more: 256, computed
128 at a time). On a decode-only step only the decode blocks make a program of their own
(`applies`). Larger mixed blocks are left out for their compile time,
not their speed: its mixed kernel unrolls every query compute block of every kv head, and
query blocks of 256 with kv chunks of 1024 had not finished compiling for v5e on vLLM's
512-token step after 7 minutes, where vLLM's blocks (chunks of 512) took 6.5 to compile and
analyse (2 cores shared with other jobs). On that step (v5e-4, static cycles: RPAd + RPAm +
the other ops) vLLM's blocks took 834,252 + 135,742 + 23,838, decode blocks of 2048 with
chunks of 1024 645,102 + 135,742 + 23,838, and with mixed query blocks of 128 645,102 +
139,826 + 23,838; all below its HBM time (1.47 ms, 2.2M cycles). Quick: decode blocks of 2048
with chunks of 1024, vLLM's mixed blocks; vLLM's heuristic for both on the steps whose
sequences hold fewer than 2048 positions (the shared-prefix rows), which those blocks do not
take."""


def applies(blocks: StepBlocks, workload: Workload) -> bool:
    """Whether it takes the workload in this configuration: a ragged step (paged, floating
    point, one chip: `Workload`'s checks), blocks that are whole pages, a query block the
    compute block divides, kv blocks no longer than a sequence's capacity, and both kernels'
    blocks within the core's VMEM; never where its ``unless`` blocks apply."""
    w = workload
    if w.op != "ragged" or (blocks.unless is not None and applies(blocks.unless, w)):
        return False
    if w.prefill is None and blocks.mixed is not None:  # no chunk: the same program as
        return False  # the heuristic's mixed blocks make
    size = rpa_reference.page_size(w)
    decode, mixed = blocks.decode_of(w), blocks.mixed_of(w)
    return (
        max(decode.kv, mixed.kv) <= w.seq_len
        and decode.kv % decode.kv_compute == 0
        and decode.kv_compute % size == 0
        and mixed.kv % mixed.kv_compute == 0
        and mixed.kv_compute % size == 0
        and mixed.q % mixed.q_compute == 0
        and rpa_reference.fits_vmem(w, 1, decode.kv)
        and rpa_reference.fits_vmem(w, mixed.q, mixed.kv)
    )


def arguments(workload: Workload) -> list[ArraySpec]:
    """``queries [tokens, q_heads, head_dim]``, ``keys, values [tokens, kv_heads, head_dim]``,
    the cache (`rpa_reference.cache_shape`), ``kv_lens [seqs]``, ``page_indices [seqs x
    pages_per_seq]``, ``cu_q_lens [seqs + 1]`` and ``distribution [3]``."""
    w = workload
    seqs = len(w.sequence_lengths)
    new = ArraySpec((w.tokens, w.kv_heads, w.head_dim), w.dtype)
    return [
        ArraySpec((w.tokens, w.q_heads, w.head_dim), w.dtype),
        new,
        new,
        ArraySpec(rpa_reference.cache_shape(w), w.dtype),
        ArraySpec((seqs,), "int32"),
        ArraySpec((seqs * (w.seq_len // w.page_size),), "int32"),
        ArraySpec((seqs + 1,), "int32"),
        ArraySpec((3,), "int32"),
    ]


def distribution(workload: Workload) -> tuple[int, int, int]:
    """``(decode_end, prefill_end, mixed_end)``: the decoding sequences, then the chunks in
    the mixed kernel."""
    seqs = len(workload.sequence_lengths)
    return workload.batch, workload.batch, seqs


def build(blocks: StepBlocks, workload: Workload) -> Callable[..., object] | None:
    """``ragged_paged_attention`` on the step, or None where it does not apply (`applies`),
    writing the new tokens (``update_kv_cache=True``); it returns the output and the cache,
    donated (`rpa_reference.donate`)."""
    from pallas_flash.tpu import current_generation

    w = workload
    if not applies(blocks, w):
        return None
    rpa = rpa_reference.load_kernel()
    decode, mixed = blocks.decode_of(w), blocks.mixed_of(w)

    def step(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, dist):
        return rpa.ragged_paged_attention(
            queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, dist,
            update_kv_cache=True,
            sm_scale=1 / math.sqrt(w.head_dim),
            sliding_window=w.sliding_window,
            d_block_sizes=(1, decode.kv, 1, decode.kv_compute),
            m_block_sizes=tuple(mixed),
            vmem_limit_bytes=current_generation().vmem_bytes,
        )  # fmt: skip

    return step


def loop_trips(blocks: StepBlocks, workload: Workload, kernel: str) -> tuple[int, ...] | None:
    """How often its ``while`` loops run over the whole kernel on the step
    (`Subject.loop_trips`), in program order (`rpa_reference.kernel_trips`; the cache writes
    of a kv block start before its compute chunks): RPAd, over the decoding sequences, its
    sequences, kv blocks, written pages and compute chunks (its one query block is no loop);
    RPAm, over the chunks, its sequences, query blocks, kv blocks, written pages and compute
    chunks. None for another kernel."""
    w = workload
    seqs = len(w.sequence_lengths)
    if kernel.startswith(rpa_reference.DECODE_KERNEL):
        d = blocks.decode_of(w)
        t = rpa_reference.kernel_trips(w, slice(0, w.batch), 1, d.kv, d.kv_compute, update=True)
        return t.sequences, t.kv_blocks, t.written_pages, t.chunks
    if kernel.startswith(rpa_reference.MIXED_KERNEL):
        m = blocks.mixed_of(w)
        t = rpa_reference.kernel_trips(w, slice(w.batch, seqs), m.q, m.kv, m.kv_compute,
                                       update=True)  # fmt: skip
        return t.sequences, t.query_blocks, t.kv_blocks, t.written_pages, t.chunks
    return None


def notes(workload: Workload) -> list[str]:
    """What its rows rest on."""
    return [
        "tpu-inference-rpa-v3 on a mixed step: distribution (decodes, decodes, sequences) "
        "hands the decoding sequences to its decode kernel (RPAd) and the prefill chunks to "
        "its mixed kernel (RPAm); their loops over the sequences, query blocks, kv blocks, "
        "compute chunks and written pages read their trip counts from distribution, cu_q_lens "
        "and kv_lens and are charged the runs the step gives (Subject.loop_trips); "
        "update_kv_cache=True: it writes the new tokens into their pages, as "
        "pf.ragged_attention does",
    ]
