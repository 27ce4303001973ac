"""jax's ``paged_attention`` as the decode reference: a batch-1 contiguous cache read as the
pages of one sequence, and the serving workloads' paged caches (bfloat16 or int8) in its own
layout.

Its layout is ``[kv_heads, num_pages, page_size, head_dim]`` (ours: ``[num_pages, kv_heads,
page_size, head_dim]``) and its int8 scales ``[kv_heads, num_pages, page_size, 1]``: a paged
workload hands it arrays in that layout (`arguments`), so that no transpose of the pool is
charged to it. A contiguous cache of more than one sequence is not its layout without a copy,
so it is compared on the paged workloads only. Its blocks of pages run as grid steps
(``inline_seq_dim=False``): jax's default runs them in a loop inside each step whose trip
count reads ``lengths``, and a static schedule counts that loop's body once. Its one loop
left, the search for the next sequence of non-zero length, runs only past an empty sequence
(`loop_trips`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp

from pallas_flash_bench.kernels.subjects import array_specs
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.aot.program_ref import ArraySpec

PAGE_SIZE = 128
"""Cache positions per page when a batch-1 contiguous cache is read as pages."""

BLOCKS = {"quick": [16], "default": [8, 16]}
"""Pages per compute block to try."""


def arguments(workload: Workload) -> list[ArraySpec]:
    """Its arrays: ours (`array_specs`) but for a paged workload's pool, ``[kv_heads,
    num_pages, page_size, head_dim]``, and int8 scales, ``[kv_heads, num_pages, page_size, 1]``
    (a batch-1 contiguous cache's too: its pages of `PAGE_SIZE`)."""
    specs = array_specs(workload)
    w = workload
    if w.op != "decode":
        return specs
    paged = w.cache == "paged"
    if paged:
        pool = ArraySpec((w.kv_heads, w.num_pages, w.page_size, w.head_dim), specs[1].dtype)
        specs[1] = specs[2] = pool
    if w.cache_dtype == "int8":
        page_size = w.page_size if paged else PAGE_SIZE
        pages = w.num_pages if paged else w.batch * w.seq_len // page_size
        scales = ArraySpec((w.kv_heads, pages, page_size, 1), "float32")
        specs[-2:] = [scales, scales]
    return specs


def build(pages_per_block: int, workload: Workload) -> Callable[..., object] | None:
    """``paged_attention`` on the workload, or None where it does not apply (attention, a
    contiguous cache of several sequences, or blocks that do not divide a sequence's pages)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import (
        QuantizedTensor,
    )

    w = workload
    if w.op != "decode":
        return None
    paged = w.cache == "paged"
    page_size = w.page_size if paged else PAGE_SIZE
    if w.seq_len % (page_size * pages_per_block) or (not paged and w.batch != 1):
        return None
    pages = w.seq_len // page_size
    scale = 1 / math.sqrt(w.head_dim)

    def decode(q, k_pages, v_pages, lengths, *extra):  # paged_attention applies no scale
        if paged:
            table, scales = extra[0], extra[1:]
        else:  # one sequence: its contiguous cache, by a free reshape, is its pages in order
            shape = (w.kv_heads, pages, page_size, w.head_dim)
            k_pages, v_pages = k_pages.reshape(shape), v_pages.reshape(shape)
            table, scales = jnp.arange(pages, dtype=jnp.int32)[None], extra
        if scales:  # its scales are max|x| per row (ours: max|x| / 127), given in its own terms
            k_pages, v_pages = (
                QuantizedTensor(k_pages, scales[0]),
                QuantizedTensor(v_pages, scales[1]),
            )
        return paged_attention(
            q * jnp.asarray(scale, q.dtype),
            k_pages,
            v_pages,
            lengths,
            table,
            pages_per_compute_block=pages_per_block,
            inline_seq_dim=False,
        )

    return decode


KERNEL = "paged_attention"
"""How its kernel's name begins."""


def loop_trips(pages_per_block: int, workload: Workload, kernel: str) -> tuple[int, ...] | None:
    """How often its loop without a trip count runs over the whole kernel (`Subject.loop_trips`):
    the ``fori_loop`` that, when a grid step moves to the next sequence and that sequence is
    empty, searches for the next of non-zero length (``advance_to_next_non_zero_length``),
    from that sequence on: its bound reads the batch index. None for another kernel, a batch
    of one (no next sequence: no such loop) or a batch with an empty sequence."""
    del pages_per_block  # the search is the same for every block size
    if not kernel.startswith(KERNEL) or workload.batch == 1:
        return None
    if min(workload.sequence_lengths) == 0:
        return None
    return (0,)
