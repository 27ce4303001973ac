"""tpu-inference's Ragged Paged Attention v3 (the kernel vLLM runs on TPU) as a decode
reference: the serving workloads' bfloat16 paged caches and a batch-1 contiguous cache read as
the pages of one sequence, in its own layout.

Its layout: queries ``[tokens, q_heads, head_dim]`` and the new tokens' ``keys, values
[tokens, kv_heads, head_dim]`` (decode: one token per sequence, ``cu_q_lens = arange(batch +
1)``), one cache ``[num_pages, page_size, 2 * kv_heads / packing, packing, head_dim]`` with K
and V interleaved along the heads and packed in 32-bit words (bfloat16: 2 a word), ``kv_lens
[batch]`` (the new token included), ``page_indices [batch * pages_per_seq]`` and
``distribution [3]``: sequences ``[0:i]`` decode, ``[i:j]`` prefill, ``[j:k]`` mixed. A
workload hands it arrays in that layout (`arguments`), so that no copy into it is charged. Its
kernel takes no integer cache (fp8 only, one scale per tensor): no int8 rows.

Its program holds two Pallas kernels whatever the batch: ``RPAd`` (decode: one query per
sequence) and ``RPAm`` (mixed), each a grid of one step that loops over its range of
sequences, per sequence over its kv blocks of ``bkv`` tokens and, per block, over compute
chunks of ``bkv_compute`` tokens: ``while`` loops whose trip counts read ``distribution`` and
``kv_lens`` (`loop_trips`). The decode batch is ``distribution = (batch, batch, batch)``: RPAm
runs no sequence.

On a mixed serving step (prefill chunks beside decodes) it is built by `rpa_mixed`, which
shares this module's layout, block heuristics and loop counts (`kernel_trips`).

tpu-inference is not a dependency (its own dependencies bring vllm and torch): install it
with ``--no-deps``; its kernel is loaded without running its top-level package
(`load_kernel`).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import types
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp

from pallas_flash_bench.kernels import ragged_step
from pallas_flash_bench.kernels.ragged_reference import num_pages, page_size
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.aot.program_ref import ArraySpec

DISTRIBUTION = "tpu-inference"
"""The PyPI distribution that ships it."""

REQUIREMENT = f"{DISTRIBUTION}==0.24.0 (==0.32.0 on jax 0.12)"
"""The versions the bench was checked with, those the constraints files pin (install it with
``--no-deps``)."""

NO_INT8 = (
    "tpu-inference-rpa-v3 has no int8 rows: its kernel takes floating-point caches only "
    "(fp8 with one scale per tensor), not ours of int8 with a scale per token and kv head"
)
"""The report's note on the workloads it leaves out."""

KERNEL_MODULE = "tpu_inference.kernels.ragged_paged_attention.v3.kernel"


def load_kernel() -> types.ModuleType:
    """RPA v3's kernel module, imported without running ``tpu_inference/__init__.py``.

    That file imports vllm (not installed: tpu-inference is installed without its
    dependencies) and sets ``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS`` for this process, which the
    bench's compiles must not inherit. The kernel needs neither: the package is registered
    from its spec without being run (the packages between it and the kernel only hold licence
    headers). Raises ``ModuleNotFoundError`` when tpu-inference is not installed.
    """
    spec = importlib.util.find_spec("tpu_inference")  # a top-level name: runs nothing
    if spec is None:
        raise ModuleNotFoundError("No module named 'tpu_inference'", name="tpu_inference")
    sys.modules.setdefault("tpu_inference", importlib.util.module_from_spec(spec))
    return importlib.import_module(KERNEL_MODULE)


class DecodeBlocks(NamedTuple):
    """The decode kernel's kv block (``bkv_sz``: tokens fetched per step of its pipeline) and
    compute chunk (``bkv_csz``), both multiples of the page size; its query block is one
    token (a sequence's query)."""

    kv: int
    kv_compute: int

    @property
    def label(self) -> str:
        compute = f", compute {self.kv_compute}" if self.kv_compute != self.kv else ""
        return f"kv blocks {self.kv}{compute}"


BLOCKS = {
    "quick": [DecodeBlocks(2048, 1024)],
    "default": [
        DecodeBlocks(1024, 1024),
        DecodeBlocks(2048, 1024),
        DecodeBlocks(2048, 2048),
        DecodeBlocks(4096, 1024),
        DecodeBlocks(4096, 4096),
    ],
}
"""Decode blocks to try: kv blocks (tokens per copy of the pipeline, its pages copied one DMA
each, only those holding a token) and compute chunks. vLLM's v5e heuristic
(``get_default_block_sizes``) takes one block of as many tokens as reach the HBM's peak (16 MiB
of K and V: 4096 tokens at 8 kv heads, 1024 at 32), computed whole. Every chunk is computed
whole, a sequence's last one past its end too, so a long chunk wastes work on ragged lengths
and a short one repeats its per-chunk work. The decode kernel's static cycles (v5e; bfloat16
serving batches of 32, 32/8 and 32/32 heads; one sequence of 32k at 32/8): 2048 with chunks of
1024 325,006 / 1,070,450 / 64,674, 4096 with 1024 328,244 / -- / 64,074, 1024 328,683 /
1,074,095 / 66,170, 2048 358,594 / 1,162,469 / 64,578, 4096 429,491 / -- / 63,330; chunks of
512 lost at every block (369,033, 365,210 and 368,594 at 32/8 for blocks of 1024, 2048 and
4096), 256 more (422,825 with blocks of 1024). Blocks of 4096 at 32 kv heads need more than
v5e's 128 MiB of VMEM (`build` leaves them out). All are below the batches' HBM time (0.733 /
2.923 / 0.164 ms, i.e. 1.10M / 4.39M / 246k cycles). Quick: 2048 with chunks of 1024."""


def packing(workload: Workload) -> int:
    """Cache values per 32-bit word (bfloat16: 2)."""
    return 4 // jnp.dtype(workload.cache_dtype or workload.dtype).itemsize


def cache_shape(workload: Workload) -> tuple[int, ...]:
    """``[num_pages, page_size, ceil(2 * kv_heads / packing), packing, head_dim]`` (head_dim
    rounded up to 128), as its ``get_kv_cache_shape``."""
    w, pack = workload, packing(workload)
    heads = -(-2 * w.kv_heads // pack)
    return (num_pages(w), page_size(w), heads, pack, -(-w.head_dim // 128) * 128)


def arguments(workload: Workload) -> list[ArraySpec]:
    """``queries [batch, q_heads, head_dim]``, ``keys, values [batch, kv_heads, head_dim]``
    (the new token of each sequence, which the call takes; with ``update_kv_cache=False`` its
    kernels read every token from the cache), the cache (`cache_shape`), ``kv_lens [batch]``
    and, paged, ``page_indices [batch * pages_per_seq]``."""
    w = workload
    new = ArraySpec((w.batch, w.kv_heads, w.head_dim), w.dtype)
    specs = [
        ArraySpec((w.batch, w.q_heads, w.head_dim), w.dtype),
        new,
        new,
        ArraySpec(cache_shape(w), w.cache_dtype or w.dtype),
        ArraySpec((w.batch,), "int32"),
    ]
    if w.cache == "paged":
        specs.append(ArraySpec((w.batch * (w.seq_len // w.page_size),), "int32"))
    return specs


def _aligned(tokens: int, workload: Workload) -> int:
    """``tokens`` rounded up to whole pages."""
    return -(-tokens // page_size(workload)) * page_size(workload)


def mixed_blocks(workload: Workload) -> tuple[int, int, int, int]:
    """The mixed kernel's ``(bq, bkv, bq_compute, bkv_compute)``: vLLM's v5e heuristic
    (``get_default_block_sizes``) for the call's tokens (a decode batch's: one a sequence),
    its query compute block cut to divide the query block (the heuristic's own may not, which
    explicit blocks must). It runs no sequence of a decode batch."""
    w = workload
    per_kv_head = 1 << (w.q_heads // w.kv_heads - 1).bit_length()
    max_q = 1 << (w.tokens - 1).bit_length()
    max_kv = w.seq_len
    bq = max(1, min(1024 // per_kv_head, max_q // 2))
    bq_compute = max(1, min(512 // per_kv_head, bq))
    return bq, _aligned(min(1024, max_kv), w), bq_compute, _aligned(min(512, max_kv // 2), w)


def decode_blocks(workload: Workload) -> DecodeBlocks:
    """The decode kernel's blocks by vLLM's v5e heuristic: as many tokens as reach the HBM's
    peak (16 MiB of K and V), at most a sequence's capacity, computed whole."""
    w = workload
    heads_x2 = 1 << (-(-2 * w.kv_heads // packing(w)) * packing(w) - 1).bit_length()
    to_peak = 16 * 1024 * 1024 * packing(w) // 4 // (-(-w.head_dim // 128) * 128) // heads_x2
    kv = _aligned(min(to_peak, w.seq_len), w)
    return DecodeBlocks(kv, kv)


def fits_vmem(workload: Workload, queries: int, kv: int) -> bool:
    """Whether a kernel of ``queries`` x ``kv`` token blocks fits the target core's VMEM (its
    own ``get_vmem_estimate_bytes``)."""
    from pallas_flash.tpu import current_generation

    w = workload
    dtype, cache_dtype = jnp.dtype(w.dtype), jnp.dtype(w.cache_dtype or w.dtype)
    needed = load_kernel().get_vmem_estimate_bytes(
        w.kv_heads, w.q_heads // w.kv_heads, w.head_dim, queries, kv, dtype, cache_dtype
    )
    return needed <= current_generation().vmem_bytes


def applies(blocks: DecodeBlocks, workload: Workload) -> bool:
    """Whether it takes the workload in this configuration: decode on one chip, paged or a
    single contiguous sequence, a floating-point cache, blocks no longer than a sequence (a
    longer one repeats a shorter configuration) and multiples of its pages."""
    w = workload
    if w.op != "decode" or w.chips != 1 or (w.cache != "paged" and w.batch != 1):
        return False
    size = page_size(w)
    return (
        w.cache_dtype is None
        and blocks.kv <= w.seq_len
        and blocks.kv % blocks.kv_compute == 0
        and blocks.kv_compute % size == 0
    )


def build(blocks: DecodeBlocks, workload: Workload) -> Callable[..., object] | None:
    """``ragged_paged_attention`` on a decode batch, or None where it does not apply
    (`applies`) or its blocks need more VMEM than the target core has (its own
    ``get_vmem_estimate_bytes``). Its VMEM limit is the core's whole VMEM (``vmem_limit_bytes``,
    vLLM's own choice), the most ours request. ``update_kv_cache=False``: the workload's cache
    already holds the new token, as every subject's does, so it reads all from the cache. It
    returns the output and the cache, which its kernels update in place (an input aliased to
    an output): the cache is donated (`donate`), as vLLM donates it, or XLA copies it first."""
    from pallas_flash.tpu import current_generation

    w = workload
    if not applies(blocks, w) or not fits_vmem(w, 1, blocks.kv):
        return None
    rpa = load_kernel()
    vmem = current_generation().vmem_bytes  # the target's (the worker sets its generation)
    batch, pages_per_seq = w.batch, w.seq_len // page_size(w)

    def decode(queries, keys, values, kv_cache, kv_lens, *table):
        if table:
            (page_indices,) = table
        else:  # one sequence: its pages in order
            page_indices = jnp.arange(pages_per_seq, dtype=jnp.int32)
        return rpa.ragged_paged_attention(
            queries,
            keys,
            values,
            kv_cache,
            kv_lens,
            page_indices,
            jnp.arange(batch + 1, dtype=jnp.int32),  # cu_q_lens: one query per sequence
            jnp.full((3,), batch, jnp.int32),  # distribution: all decode
            update_kv_cache=False,
            sm_scale=1 / math.sqrt(w.head_dim),
            d_block_sizes=(1, blocks.kv, 1, blocks.kv_compute),
            m_block_sizes=mixed_blocks(w),
            vmem_limit_bytes=vmem,
        )

    return decode


def donate(workload: Workload) -> tuple[int, ...]:
    """The argument its program may overwrite, donated (`Subject.donate`): the cache."""
    return (3,)


DECODE_KERNEL = "RPAd-"
"""How its decode kernel's name begins (``RPAd-p_128-bq_1_1-bkv_2048_512``)."""
MIXED_KERNEL = "RPAm-"
"""How its mixed kernel's name begins."""


class Trips(NamedTuple):
    """Runs of a kernel's data-dependent loops over some sequences: the sequences, their
    query blocks, kv blocks, compute chunks, and the pages its cache writes walk."""

    sequences: int
    query_blocks: int
    kv_blocks: int
    chunks: int
    written_pages: int

    def __add__(self, other: tuple) -> Trips:  # type: ignore[override]
        return Trips(*(a + b for a, b in zip(self, other, strict=True)))


def sequence_trips(
    new: int,
    length: int,
    bq: int,
    bkv: int,
    bkv_compute: int,
    page: int,
    *,
    update: bool,
    window: int | None = None,
) -> Trips:
    """The loops one sequence of ``new`` tokens and ``length`` positions (the new included)
    runs, as its kernel's ``process``: per query block of ``bq`` tokens, the kv blocks up to
    its last token's position (causal: all of them for one query), from the block holding its
    first token's position less ``window`` (its ``sliding_window``: ``start_bkv_idx``), per kv
    block its compute chunks up to that position; and, with ``update``, in the last query
    block, per kv block it visits holding new tokens, the pages those tokens fall in
    (``_update_kv_cache``'s loop)."""
    query_blocks = max(1, math.ceil(new / bq))
    kv_blocks = chunks = written = 0
    start = 0
    for b in range(query_blocks):
        first = length - new + b * bq
        start = 0 if window is None else max(first - window, 0) // bkv
        seen = min(length, first + bq)
        end = math.ceil(seen / bkv)
        kv_blocks += end - start
        chunks += sum(math.ceil(min(seen - i * bkv, bkv) / bkv_compute) for i in range(start, end))
    if update:
        for i in range(start, math.ceil(length / bkv)):
            left = length - i * bkv
            cached = min(max(left - new, 0), bkv)
            fresh = min(bkv - cached, left - max(left - new, 0))
            first = i * bkv + cached
            written += math.ceil((first + fresh) / page) - first // page if fresh > 0 else 0
    return Trips(1, query_blocks, kv_blocks, chunks, written)


def kernel_trips(
    workload: Workload, sequences: slice, bq: int, bkv: int, bkv_compute: int, *, update: bool
) -> Trips:
    """`sequence_trips` summed over a kernel's ``sequences`` of the workload (within its
    sliding window, a windowed layer's step)."""
    new = ragged_step.query_lengths(workload) if workload.op == "ragged" else None
    window = workload.sliding_window if workload.op == "ragged" else None
    lengths = [max(1, int(n)) for n in workload.sequence_lengths]
    total = Trips(0, 0, 0, 0, 0)
    for s in range(len(lengths))[sequences]:
        n = 1 if new is None else int(new[s])
        page = page_size(workload)
        total += sequence_trips(n, lengths[s], bq, bkv, bkv_compute, page, update=update,
                                window=window)  # fmt: skip
    return total


def loop_trips(blocks: DecodeBlocks, workload: Workload, kernel: str) -> tuple[int, ...] | None:
    """How often its ``while`` loops run over the whole kernel (`Subject.loop_trips`),
    outermost first. RPAd: the sequences loop once per sequence, the kv-block loop
    ``ceil(length / bkv)`` times per sequence, the compute loop ``ceil(length / bkv_compute)``
    (per block, ``ceil(its tokens / bkv_compute)``); its query-block loop, of one trip, is no
    loop in the schedule. RPAm: its sequences, query-block, kv-block and compute loops run
    none. None for another kernel."""
    if kernel.startswith(DECODE_KERNEL):
        trips = kernel_trips(workload, slice(None), 1, blocks.kv, blocks.kv_compute, update=False)
        return trips.sequences, trips.kv_blocks, trips.chunks
    if kernel.startswith(MIXED_KERNEL):
        return 0, 0, 0, 0
    return None


def notes(workload: Workload) -> list[str]:
    """What its rows rest on."""
    out = [
        "tpu-inference-rpa-v3: its loops over the sequences, each sequence's kv blocks and each "
        "block's compute chunks read their trip counts from distribution and kv_lens; they are "
        "charged the runs the workload's lengths give (Subject.loop_trips), the mixed kernel "
        "(RPAm), which runs no sequence of a decode batch, none; update_kv_cache=False: the "
        "cache already holds the new token, as every subject's",
    ]
    if workload.cache != "paged":
        out.append(
            "tpu-inference-rpa-v3 reads the contiguous sequence as pages of 128 in its own "
            "layout (K and V interleaved), without a copy charged"
        )
    return out
