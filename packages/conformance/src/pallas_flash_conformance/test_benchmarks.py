"""Timing benchmarks (pytest-benchmark), run only with ``--benchmark-enable``.

Small fixed shapes, bfloat16, ``[batch, heads, seq, head_dim]``; each benchmark times a
jit-compiled call after one warm-up call that compiles it.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs

pytestmark = pytest.mark.pf_benchmark

SEQ_LENS = [256, 1024]


def _time(benchmark, fn, *args) -> None:
    compiled = jax.jit(fn)
    jax.block_until_ready(compiled(*args))
    benchmark(lambda: jax.block_until_ready(compiled(*args)))


@pytest.mark.requires("attention", "causal")
@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_forward(backend, benchmark, seq_len: int) -> None:
    q, k, v = inputs.qkv(1, 4, 4, seq_len, seq_len, 128, "bfloat16")
    _time(
        benchmark, lambda q, k, v: pf.attention(q, k, v, causal=True, backend=backend.name), q, k, v
    )


@pytest.mark.requires("attention", "causal", "grad")
@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_forward_backward(backend, benchmark, seq_len: int) -> None:
    q, k, v = inputs.qkv(1, 4, 4, seq_len, seq_len, 128, "bfloat16")

    def loss(q, k, v):
        return pf.attention(q, k, v, causal=True, backend=backend.name).astype(np.float32).sum()

    _time(benchmark, jax.grad(loss, argnums=(0, 1, 2)), q, k, v)


@pytest.mark.requires("decode")
@pytest.mark.parametrize("max_len", [1024, 8192])
def test_decode(backend, benchmark, max_len: int) -> None:
    q = inputs.normal(0, (1, 8, 128), "bfloat16")
    cache = inputs.normal(1, (1, 8, max_len, 128), "bfloat16")
    lengths = np.array([max_len], np.int32)
    _time(benchmark, lambda q, c, n: pf.decode(q, c, c, n, backend=backend.name), q, cache, lengths)
