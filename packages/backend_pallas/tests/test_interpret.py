"""The pallas kernels lower to a Mosaic kernel or to the interpreter's host callbacks, as the
environment asks (see `pallas_flash.interpret`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
from pallas_flash.interpret import INTERPRET_ENV_VAR
from pallas_flash_pallas import flash_forward


def _lowered(platform: str) -> str:
    x = jax.ShapeDtypeStruct((1, 2, 128, 64), jnp.float32)
    spec = pf.AttentionSpec(sm_scale=0.125, causal=True)

    def attention(q, k, v):
        return flash_forward(q, k, v, spec=spec)[0]

    return jax.jit(attention).trace(x, x, x).lower(lowering_platforms=(platform,)).as_text()


def test_mosaic_lowers_to_a_tpu_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERPRET_ENV_VAR, "0")
    assert "tpu_custom_call" in _lowered("tpu")


def test_interpreter_lowers_to_host_callbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERPRET_ENV_VAR, "1")
    text = _lowered("cpu")
    assert "tpu_custom_call" not in text
    assert "callback" in text
