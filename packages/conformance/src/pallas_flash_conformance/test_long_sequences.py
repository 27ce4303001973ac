"""Parity at lengths where a kernel backend's default blocks (thousands of rows) span several
blocks, so the tiling users get is itself checked, not only the small tilings of the other
tests. One head keeps the float64 reference and an interpreted kernel affordable on a CPU."""

from __future__ import annotations

import jax
import pytest

from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.calls import Case
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close, assert_gradient_close

CASES = {
    # 9216 and 8192 causal: several query and kv blocks at every default; 6144: a length the
    # defaults do not divide (balanced blocks); q-short: fewer queries than keys, with a
    # window and GQA.
    "9216": Case(1, 1, 1, 9216, 9216, 128, "bfloat16"),
    "8192-causal": Case(1, 1, 1, 8192, 8192, 128, "bfloat16", causal=True),
    "6144-causal-segments": Case(1, 1, 1, 6144, 6144, 128, "bfloat16", causal=True, segments=3),
    "q-short-window-gqa": Case(1, 2, 1, 3000, 8192, 128, "bfloat16", sliding_window=(1500, 0)),
}


@pytest.mark.parametrize("case", [case.param(name) for name, case in CASES.items()])
def test_long_forward(backend, case: Case) -> None:
    q, k, v = case.arrays()
    assert_close(
        case.run(backend.name, q, k, v), case.reference(q, k, v), FORWARD_TOLERANCE[case.dtype]
    )


@pytest.mark.parametrize(
    "case", [CASES[name].param(name, "grad") for name in ("8192-causal", "q-short-window-gqa")]
)
def test_long_gradients(backend, case: Case) -> None:
    q, k, v = case.arrays()
    d_out = inputs.normal(case.seed + 3, q.shape, case.dtype)

    @jax.jit
    def gradients(q, k, v, d_out):
        _, vjp = jax.vjp(lambda q, k, v: case.run(backend.name, q, k, v), q, k, v)
        return vjp(d_out)

    expected = reference.attention_vjp(q, k, v, d_out, **case.reference_kwargs())
    for name, actual, wanted in zip(
        ("dq", "dk", "dv"), gradients(q, k, v, d_out), expected, strict=True
    ):
        assert_gradient_close(actual, wanted, case.dtype, name=name)
