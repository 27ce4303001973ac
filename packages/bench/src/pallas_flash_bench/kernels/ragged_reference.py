"""jax's ``ragged_paged_attention`` as a decode reference: the serving workloads' paged caches
(bfloat16 or int8) and a batch-1 contiguous cache read as the pages of one sequence, each in
its own layout.

Its layout: queries ``[tokens, q_heads, head_dim]`` (decode: one token per sequence,
``cu_q_lens = arange(batch + 1)``), one pool ``[num_pages, page_size, 2 * kv_heads,
head_dim]`` with K and V interleaved along the heads, ``kv_lens [batch]``, ``page_indices
[batch, pages_per_seq]`` and ``num_seqs [1]``. A workload hands it arrays in that layout
(`arguments`), so that no copy into it is charged. Its int8 takes one scale per tensor (static
``k_scale`` / ``v_scale``: no scale arrays), ours one per token and kv head.

Its grid is ``(head blocks, query blocks)``; each step loops over the sequences whose queries
the block holds and, per sequence, over its kv blocks of ``num_kv_pages_per_block`` pages,
both ``while`` loops whose trip counts read ``kv_lens`` and ``cu_q_lens``. A static schedule
runs such a loop's body once: `loop_trips` gives each loop's executions over the whole kernel
from the workload's lengths, with which `pallas_flash_estimate.cost.spread` weighs its bundles.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp

from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.aot.program_ref import ArraySpec

PAGE_SIZE = 128
"""Cache positions per page when a batch-1 contiguous cache is read as pages."""

INT8_SCALE = 0.05
"""The per-tensor scale handed to it for an int8 cache (a static float: its value does not
change the program)."""


class RaggedBlocks(NamedTuple):
    """``num_kv_pages_per_block`` and ``num_queries_per_block``."""

    kv_pages: int
    queries: int

    @property
    def label(self) -> str:
        return f"{self.kv_pages} pages x {self.queries} queries"


BLOCKS = {
    "quick": [RaggedBlocks(8, 2)],
    "default": [
        RaggedBlocks(4, 4),
        RaggedBlocks(8, 2),
        RaggedBlocks(8, 4),
        RaggedBlocks(8, 8),
        RaggedBlocks(16, 4),
        RaggedBlocks(16, 8),
    ],
}
"""Blocks to try: kv pages per block and queries (sequences, in decode) per block. jax's
tuned table for v5e (``tuned_block_sizes``) has no entry for these shapes; its default is
128 pages x 32 queries (clamped to the pages of a sequence). Each kv block of a sequence is
multiplied with all the block's queries and copies all its pages, so small blocks win. On the
int8 serving batches of 32/8 heads (v5e, static, batch 32 / 128) 8 pages x 2 queries was its
fastest: 0.379 / 1.491 ms; 8 x 1 0.383 / 1.503, 8 x 4 0.413 / 1.621, 4 x 4 0.425 / 1.650,
16 x 4 0.443 / 1.716, 8 x 8 0.479 / 1.881, 4 x 8 0.523 / 2.031, 16 x 8 -- / 1.97, 32 x 8
-- / 2.22, 16 x 16 -- / 2.37, 16 x 32 -- / 3.13 (8 x 1, 4 x 8 and the larger blocks left
out). Quick: 8 x 2."""


def page_size(workload: Workload) -> int:
    """Its pages: the workload's, or `PAGE_SIZE` for a contiguous cache."""
    return workload.page_size if workload.cache == "paged" else PAGE_SIZE


def num_pages(workload: Workload) -> int:
    """Pages of its pool: a paged workload's, or a contiguous cache's ``batch x seq_len /
    PAGE_SIZE``."""
    w = workload
    return w.num_pages if w.cache == "paged" else w.batch * w.seq_len // PAGE_SIZE


def arguments(workload: Workload) -> list[ArraySpec]:
    """``q [batch, q_heads, head_dim]``, ``kv_pages [num_pages, page_size, 2 * kv_heads,
    head_dim]`` (K and V interleaved, the cache's dtype), ``kv_lens [batch]`` and, paged,
    ``page_indices [batch, pages_per_seq]``. No scales: its int8 scale is a static float."""
    w = workload
    specs = [
        ArraySpec((w.batch, w.q_heads, w.head_dim), w.dtype),
        ArraySpec(
            (num_pages(w), page_size(w), 2 * w.kv_heads, w.head_dim), w.cache_dtype or w.dtype
        ),
        ArraySpec((w.batch,), "int32"),
    ]
    if w.cache == "paged":
        specs.append(ArraySpec((w.batch, w.seq_len // w.page_size), "int32"))
    return specs


def min_hbm_bytes(workload: Workload) -> float:
    """The least it must move: the workload's (`Workload.min_hbm_bytes`) but for the int8
    scales, which it does not read (one per tensor, a constant)."""
    w = workload
    scales = 2 * w.kv_heads * 4 * float(w.sequence_lengths.sum()) if w.cache_dtype else 0.0
    return w.min_hbm_bytes - scales


def applies(blocks: RaggedBlocks, workload: Workload) -> bool:
    """Whether it takes the workload in this configuration: decode on one chip, paged or a
    single contiguous sequence, blocks no larger than a sequence's pages or the batch (larger
    ones would repeat a smaller configuration), but the fewest queries of `BLOCKS`, clamped to
    a smaller batch."""
    w = workload
    if w.op != "decode" or w.chips != 1 or (w.cache != "paged" and w.batch != 1):
        return False
    pages_per_seq = w.seq_len // page_size(w)
    fewest = min(b.queries for sweep in BLOCKS.values() for b in sweep)
    return blocks.kv_pages <= pages_per_seq and blocks.queries <= max(w.batch, fewest)


def build(blocks: RaggedBlocks, workload: Workload) -> Callable[..., object] | None:
    """``ragged_paged_attention`` on the workload, or None where it does not apply (`applies`).
    Its VMEM limit is the target core's whole VMEM (``vmem_limit_bytes``), the most ours
    request."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    from pallas_flash.tpu import current_generation

    w = workload
    if not applies(blocks, w):
        return None
    batch = w.batch
    pages_per_seq = w.seq_len // page_size(w)
    int8 = w.cache_dtype == "int8"
    vmem = current_generation().vmem_bytes  # the target's (the worker sets its generation)

    def decode(q, kv_pages, kv_lens, *table):
        if table:
            (page_indices,) = table
        else:  # one sequence: its pages in order
            page_indices = jnp.arange(pages_per_seq, dtype=jnp.int32)[None]
        return ragged_paged_attention(
            q,
            kv_pages,
            kv_lens,
            page_indices,
            jnp.arange(batch + 1, dtype=jnp.int32),  # cu_q_lens: one query per sequence
            jnp.array([batch], jnp.int32),  # num_seqs
            sm_scale=1 / math.sqrt(w.head_dim),
            k_scale=INT8_SCALE if int8 else None,
            v_scale=INT8_SCALE if int8 else None,
            num_kv_pages_per_block=blocks.kv_pages,
            num_queries_per_block=min(blocks.queries, batch),  # as jax's own choice clamps
            vmem_limit_bytes=vmem,
        )

    return decode


KERNEL_NAME = "ragged_paged_attention_kernel"
"""The name its ``pallas_call`` gives the kernel (HLO op ``ragged_paged_attention_kernel.1``)."""


def head_blocks(workload: Workload) -> int:
    """Its grid's first axis: the query heads over the heads it takes per step (as many kv heads
    as fill its tiling, ``get_min_heads_per_blk``)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import (
        get_min_heads_per_blk,
    )

    w = workload
    q_heads, _ = get_min_heads_per_blk(
        w.q_heads, 2 * w.kv_heads, jnp.dtype(w.dtype), jnp.dtype(w.cache_dtype or w.dtype)
    )
    return w.q_heads // q_heads


def loop_trips(blocks: RaggedBlocks, workload: Workload, kernel: str) -> tuple[int, int] | None:
    """How often its two ``while`` loops run over the whole kernel (`Subject.loop_trips`), per
    head block: the sequences loop once per sequence (a query block of decode holds
    ``num_queries_per_block`` sequences, each one query, and is done at its last), the kv-block
    loop ``ceil(length / (num_kv_pages_per_block x page_size))`` times per sequence (its
    condition: ``kv_blk_idx x num_kv_per_blk < kv_len``). None for another kernel."""
    if not kernel.startswith(KERNEL_NAME):
        return None
    per_block = blocks.kv_pages * page_size(workload)
    kv_blocks = sum(max(1, math.ceil(int(n) / per_block)) for n in workload.sequence_lengths)
    heads = head_blocks(workload)
    return heads * workload.batch, heads * kv_blocks


def notes(workload: Workload) -> list[str]:
    """What its rows rest on."""
    out = [
        "jax-ragged-paged: its loops over a query block's sequences and each sequence's kv "
        "blocks read their trip counts from kv_lens; they are charged the runs the workload's "
        "lengths give (Subject.loop_trips), the prefetch of the next block on every kv block "
        "(it skips the kernel's last only); each kv block copies all its pages, past a "
        "sequence's end too (the dma estimate shows it)",
    ]
    if workload.cache_dtype == "int8":
        out.append(
            "jax-ragged-paged's int8 takes one scale per tensor (static k_scale / v_scale), "
            "ours one per token and kv head: its HBM time counts no scale bytes"
        )
    if workload.cache != "paged":
        out.append(
            f"jax-ragged-paged reads the contiguous sequence as pages of {PAGE_SIZE} in its own "
            "layout (K and V interleaved), without a copy charged"
        )
    return out
