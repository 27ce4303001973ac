"""Wall-clock latency where the code runs: a real TPU, or (labelled as such) the CPU.

Warm-up call (compiles), then ``repeats`` timed calls with ``block_until_ready`` and
``time.perf_counter``; the median is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from pallas_flash.kv_packing import PACKED_DTYPE
from pallas_flash_bench.kernels import ragged_step
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.aot.program_ref import ArraySpec

CPU_SCORE_BYTES_LIMIT = 1 << 30
"""On CPU, only workloads whose float32 score matrix fits in this many bytes are timed."""


def platform() -> str:
    return jax.default_backend()


def random_arrays(specs: list[ArraySpec], workload: Workload) -> list[jax.Array]:
    """Normal floats for q/k/v (and int8 caches' values and scales; a packed pool's keys and
    values in the workload's dtype, `pf.pack_kv`); the workload's lengths
    (`Workload.sequence_lengths`; attention has none) and, for a paged cache, a page table that
    hands every sequence its own pages of the pool in shuffled order (the arguments' order of
    `subjects.array_specs`)."""
    rng = np.random.default_rng(0)

    def normal(spec: ArraySpec) -> jax.Array:
        if jnp.dtype(spec.dtype) == PACKED_DTYPE:
            k, v = (rng.standard_normal(spec.shape) for _ in range(2))
            return pf.pack_kv(jnp.asarray(k, workload.dtype), jnp.asarray(v, workload.dtype))
        if jnp.issubdtype(jnp.dtype(spec.dtype), jnp.integer):
            return jnp.zeros(spec.shape, spec.dtype)
        return jnp.asarray(rng.standard_normal(spec.shape), dtype=spec.dtype)

    arrays = [normal(spec) for spec in specs]
    if workload.op == "ragged":  # page_table, query_starts, kv_lengths (`ragged_specs`)
        tables = (ragged_step.page_table(workload, rng), ragged_step.query_starts(workload),
                  workload.sequence_lengths)  # fmt: skip
        arrays[-3:] = [jnp.asarray(t, jnp.int32) for t in tables]
    if workload.op == "decode":
        lengths = workload.sequence_lengths
        arrays[3] = jnp.asarray(lengths, jnp.int32)
        if workload.cache == "paged":
            pages = iter(rng.permutation(workload.num_pages))
            table = np.zeros(specs[4].shape, np.int32)
            for b, length in enumerate(lengths):
                for j in range(-(-int(length) // workload.page_size)):
                    table[b, j] = next(pages)
            arrays[4] = jnp.asarray(table)
    return arrays


def median_seconds(fn: Callable[..., object], args: list[jax.Array], repeats: int = 5) -> float:
    compiled = jax.jit(fn)
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
