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

from pallas_flash_bench.subjects import ArraySpec

CPU_SCORE_BYTES_LIMIT = 1 << 30
"""On CPU, only workloads whose float32 score matrix fits in this many bytes are timed."""


def platform() -> str:
    return jax.default_backend()


def random_arrays(specs: list[ArraySpec], seq_len: int) -> list[jax.Array]:
    """Normal floats for q/k/v; integer arguments (decode lengths) are the full length."""
    rng = np.random.default_rng(0)
    arrays = []
    for spec in specs:
        if jnp.issubdtype(jnp.dtype(spec.dtype), jnp.integer):
            arrays.append(jnp.full(spec.shape, seq_len, dtype=spec.dtype))
        else:
            arrays.append(jnp.asarray(rng.standard_normal(spec.shape), dtype=spec.dtype))
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
