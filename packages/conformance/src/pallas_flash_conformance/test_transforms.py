"""JAX transformations of a backend's calls: ``jax.vmap`` over an extra leading axis, of the
forward, the gradients and decoding, must equal the calls one slice at a time."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.calls import Case
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close, assert_gradient_close

SLICES = 2
"""Size of the vmapped axis."""

CASES = {
    "causal-gqa": Case(1, 4, 2, 96, 96, 64, causal=True),
    "window-q-short": Case(2, 2, 2, 40, 130, 128, sliding_window=(12, 3)),
}


def _stacked(case: Case) -> tuple[tuple[np.ndarray, ...], list[Case]]:
    """``(q, k, v)`` with a leading axis of `SLICES`, and the case of each slice."""
    cases = [dataclasses.replace(case, seed=seed) for seed in range(SLICES)]
    arrays = zip(*(c.arrays() for c in cases), strict=True)
    return tuple(np.stack([np.asarray(a) for a in each]) for each in arrays), cases


@pytest.mark.parametrize("case", [case.param(name) for name, case in CASES.items()])
def test_vmap_attention(backend, case: Case) -> None:
    (q, k, v), cases = _stacked(case)
    out = jax.vmap(lambda q, k, v: case.run(backend.name, q, k, v))(q, k, v)
    assert out.shape == (SLICES, *q.shape[1:])
    for i, each in enumerate(cases):
        assert_close(out[i], each.reference(q[i], k[i], v[i]), FORWARD_TOLERANCE[case.dtype])


@pytest.mark.requires("attention")
def test_vmap_attention_over_queries_only(backend) -> None:
    """k and v are not mapped: every slice of queries attends to the same keys."""
    case = Case(1, 2, 2, 64, 64, 64)
    (q, _, _), cases = _stacked(case)
    _, k, v = case.arrays()
    out = jax.vmap(lambda q: case.run(backend.name, q, k, v))(q)
    for i, each in enumerate(cases):
        assert_close(out[i], each.reference(q[i], k, v), FORWARD_TOLERANCE[case.dtype])


@pytest.mark.requires("attention", "bias", "gqa")
@pytest.mark.parametrize("bias_mapped", [False, True], ids=["shared-bias", "mapped-bias"])
def test_vmap_attention_with_a_broadcast_bias(backend, bias_mapped: bool) -> None:
    """A bias ``[1, heads, q_len, kv_len]`` (broadcast over a batch of 2) shared by every
    slice, or one per slice."""
    case = Case(2, 4, 2, 40, 72, 64)
    (q, k, v), _ = _stacked(case)
    biases = np.stack([np.asarray(inputs.normal(7 + i, (1, 4, 40, 72))) for i in range(SLICES)])

    def attention(q, k, v, bias):
        return pf.attention(q, k, v, bias=bias, backend=backend.name)

    if bias_mapped:
        out = jax.vmap(attention)(q, k, v, biases)
    else:
        out = jax.vmap(attention, in_axes=(0, 0, 0, None))(q, k, v, biases[0])
    for i in range(SLICES):
        bias = biases[i] if bias_mapped else biases[0]
        expected = reference.attention(q[i], k[i], v[i], sm_scale=64**-0.5, bias=bias)
        assert_close(out[i], expected, FORWARD_TOLERANCE[case.dtype])


@pytest.mark.parametrize(
    "case", [case.param(name, "grad") for name, case in CASES.items() if name == "causal-gqa"]
)
def test_vmap_gradients(backend, case: Case) -> None:
    (q, k, v), cases = _stacked(case)
    d_out = np.stack(
        [np.asarray(inputs.normal(3 + i, q.shape[1:], case.dtype)) for i in range(SLICES)]
    )

    def gradients(q, k, v, d_out):
        _, vjp = jax.vjp(lambda q, k, v: case.run(backend.name, q, k, v), q, k, v)
        return vjp(d_out)

    actual = jax.jit(jax.vmap(gradients))(q, k, v, d_out)
    for i, each in enumerate(cases):
        expected = reference.attention_vjp(q[i], k[i], v[i], d_out[i], **each.reference_kwargs())
        for name, got, wanted in zip(("dq", "dk", "dv"), actual, expected, strict=True):
            assert_gradient_close(got[i], wanted, case.dtype, name=f"slice {i} {name}")


@pytest.mark.requires("decode", "gqa")
def test_vmap_decode(backend) -> None:
    batch, q_heads, kv_heads, max_len, head_dim = 2, 4, 2, 130, 64
    q = inputs.normal(0, (SLICES, batch, q_heads, head_dim), "float32")
    k_cache = inputs.normal(1, (SLICES, batch, kv_heads, max_len, head_dim), "float32")
    v_cache = inputs.normal(2, (SLICES, batch, kv_heads, max_len, head_dim), "float32")
    lengths = np.array([[130, 1], [0, 77]], np.int32)
    out = jax.vmap(lambda *args: pf.decode(*args, backend=backend.name))(
        q, k_cache, v_cache, lengths
    )
    for i in range(SLICES):
        expected = reference.decode(
            q[i], k_cache[i], v_cache[i], lengths[i], sm_scale=1 / math.sqrt(head_dim)
        )
        assert_close(out[i], expected, FORWARD_TOLERANCE["float32"], name=f"slice {i}")


@pytest.mark.requires("decode", "paged_cache", "int8_cache")
@pytest.mark.parametrize("pool_mapped", [True, False], ids=["own-pools", "shared-pool"])
def test_vmap_paged_int8_decode(backend, pool_mapped: bool) -> None:
    """Each slice reads its own page pool through its own table (page indices are per pool),
    or all slices share one pool."""
    batch, q_heads, kv_heads, page_size, head_dim, num_pages = 2, 4, 2, 16, 64, 5
    pools = SLICES if pool_mapped else 1
    k8, k_scales = pf.quantize_int8(
        inputs.normal(1, (pools, num_pages, kv_heads, page_size, head_dim))
    )
    v8, v_scales = pf.quantize_int8(
        inputs.normal(2, (pools, num_pages, kv_heads, page_size, head_dim))
    )
    q = inputs.normal(0, (SLICES, batch, q_heads, head_dim))
    tables = np.array([[[4, 0], [1, 2]], [[3, 1], [0, 4]]], np.int32)
    lengths = np.array([[20, 5], [32, 0]], np.int32)
    pool_axis = 0 if pool_mapped else None
    pool = (k8, v8, k_scales, v_scales) if pool_mapped else (k8[0], v8[0], k_scales[0], v_scales[0])

    def decode(q, k, v, lengths, table, ks, vs):
        return pf.decode(
            q, k, v, lengths, page_table=table, k_scales=ks, v_scales=vs, backend=backend.name
        )

    axes = (0, pool_axis, pool_axis, 0, 0, pool_axis, pool_axis)
    out = jax.vmap(decode, in_axes=axes)(q, pool[0], pool[1], lengths, tables, pool[2], pool[3])
    for i in range(SLICES):
        p = i if pool_mapped else 0
        k, v = (
            reference.gather_pages(reference.dequantize(x[p], s[p]), tables[i])
            for x, s in ((k8, k_scales), (v8, v_scales))
        )
        expected = reference.decode(q[i], k, v, lengths[i], sm_scale=1 / math.sqrt(head_dim))
        assert_close(out[i], expected, FORWARD_TOLERANCE["float32"], name=f"slice {i}")
