"""Gradient parity (dq, dk, dv) of ``pf.attention`` against the float64 reference."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.calls import Case
from pallas_flash_conformance.parity import assert_gradient_close

CASES = {
    "plain": Case(1, 2, 2, 64, 64, 64),
    "len130-d256": Case(1, 2, 2, 130, 130, 256),
    "causal-q-short": Case(2, 4, 2, 33, 96, 64, causal=True),
    "causal-q-long": Case(1, 2, 2, 96, 40, 128, causal=True),
    "mqa": Case(1, 8, 1, 40, 72, 128),
    "window": Case(1, 2, 2, 64, 64, 96, sliding_window=(12, 3)),
    "softcap": Case(1, 2, 2, 64, 64, 64, softcap=1.5, q_scale=4.0),
    "segment-ids": Case(2, 2, 2, 64, 64, 64, segments=3),
    "all": Case(1, 4, 2, 80, 80, 64, causal=True, sliding_window=17, softcap=3.0, segments=2),
    "sinks": Case(2, 4, 2, 64, 64, 64, sinks=True),
    "mla-192-128-causal": Case(1, 4, 2, 96, 96, 192, causal=True, v_head_dim=128),
    "v-wider-len130": Case(1, 2, 2, 130, 130, 64, v_head_dim=128),
    "causal-sinks-q-long": Case(1, 2, 2, 96, 40, 128, causal=True, sinks=True),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [case.param(name, "grad") for name, case in CASES.items()])
def test_gradients(backend, case: Case, dtype: str) -> None:
    case = dataclasses.replace(case, dtype=dtype)
    q, k, v = case.arrays()
    d_out = inputs.normal(case.seed + 3, (*q.shape[:-1], v.shape[-1]), dtype)

    @jax.jit
    def gradients(q, k, v, d_out):
        _, vjp = jax.vjp(lambda q, k, v: case.run(backend.name, q, k, v), q, k, v)
        return vjp(d_out)

    expected = reference.attention_vjp(q, k, v, d_out, **case.reference_kwargs())
    for name, primal, actual, wanted in zip(
        ("dq", "dk", "dv"), (q, k, v), gradients(q, k, v, d_out), expected, strict=True
    ):
        assert actual.dtype == primal.dtype, f"{name}: dtype {actual.dtype} != {primal.dtype}"
        assert_gradient_close(actual, wanted, dtype, name=name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "case",
    [case.param(name, "grad") for name, case in CASES.items() if case.sinks],
)
def test_sinks_gradient(backend, case: Case, dtype: str) -> None:
    """The gradient of float32 sinks, whatever q's dtype, against the reference (a sum over
    the batch and every row of each head)."""
    case = dataclasses.replace(case, dtype=dtype)
    q, k, v = case.arrays()
    sinks = case.sink_logits()
    d_out = inputs.normal(case.seed + 3, (*q.shape[:-1], v.shape[-1]), dtype)

    @jax.jit
    def gradient(sinks, d_out):
        _, vjp = jax.vjp(lambda s: case.run(backend.name, q, k, v, sinks=s), sinks)
        return vjp(d_out)[0]

    actual = gradient(sinks, d_out)
    assert actual.dtype == sinks.dtype
    wanted = reference.sinks_vjp(q, k, v, d_out, **case.reference_kwargs())
    assert_gradient_close(actual, wanted, dtype, name="dsinks")
