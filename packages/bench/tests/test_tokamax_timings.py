"""tokamax's autotuning timings as calibration points: which keys are read, how each becomes a
program, and which the fit sees (synthetic data files, as tokamax's, with no tokamax needed)."""

from __future__ import annotations

import json

import pytest

from pallas_flash_bench.calibration import calibration_points, tokamax_timings
from pallas_flash_estimate import calibration

PLAIN = {
    "q": "bf16[4,4096,16,128]", "k": "bf16[4,4096,16,128]", "v": "bf16[4,4096,16,128]",
    "precision": [["DEFAULT", "DEFAULT"], ["DEFAULT", "DEFAULT"]], "logits_dtype": "float32",
    "logits_scale": 128**-0.5, "bias": None, "logits_soft_cap": None, "mask": None,
    "dropout_mask": None, "dropout_rate": 0.0, "paging_info": None, "q_indices": None,
    "k_indices": None, "normalize_output": True, "return_residuals": False,
}  # fmt: skip
CAUSAL_MASK = {"bool_mask": None, "q_start": None, "q_end": None, "k_start": None,
               "k_end": None, "causal_mask": {"offset": 0, "window_size": None}}  # fmt: skip
CONFIG = {"block_q": 1024, "block_kv": 2048, "block_kv_compute": 512, "q_layout": 2}
TIMES = {"evaluation_times_ms": [2.0, 1.0, 3.0, 9.0, 1.5]}


def _key(**changes: object) -> str:
    return json.dumps(PLAIN | changes)


@pytest.mark.parametrize(
    ("changes", "causal"),
    [
        ({}, False),
        ({"mask": CAUSAL_MASK}, True),
        ({"mask": CAUSAL_MASK | {"causal_mask": None}}, False),
        ({"mask": CAUSAL_MASK | {"causal_mask": {"offset": 0, "window_size": 128}}}, None),
        ({"mask": CAUSAL_MASK | {"k_start": 3}}, None),
        ({"logits_soft_cap": 30.0}, None),
        ({"bias": "f32[4,16,4096,4096]"}, None),
        ({"logits_scale": 1.0}, None),
        ({"q": {"qvalue": "int8[4,4096,16,128]"}}, None),
    ],
)
def test_only_plain_attention_keys_are_read(changes: dict, causal: bool | None) -> None:
    assert tokamax_timings.causal_of(PLAIN | changes) is causal


def test_a_timed_key_becomes_its_program_at_the_timed_configuration(monkeypatch) -> None:
    files = {"pallas_mosaic_tpu_flash_attention": {
        _key(mask=CAUSAL_MASK, return_residuals=True): {json.dumps(CONFIG): TIMES},
        _key(logits_soft_cap=30.0): {json.dumps(CONFIG): TIMES},
        _key(q="bf16[1,512,16,128]"): {},
    }}  # fmt: skip
    monkeypatch.setattr(tokamax_timings, "data_file", lambda g, op: files.get(op, {}))
    monkeypatch.setattr(tokamax_timings, "source", lambda g, op: f"{g} {op}")
    (point,) = tokamax_timings.points("v6e")  # the soft-capped and the untimed key left out
    assert point.measured_seconds == pytest.approx(2.0e-3)  # the median of the five
    assert point.kind == calibration.ATTENTION
    assert point.timing == "device"
    assert point.program.function.endswith(":tokamax_flash_attention")
    assert [a.shape for a in point.program.args] == [(4, 4096, 16, 128)] * 3
    kwargs = dict(point.program.kwargs)
    assert json.loads(kwargs["config"]) == CONFIG
    assert kwargs["causal"] is True and kwargs["residuals"] is True
    assert "causal, residuals, blocks 1024/2048/512" in point.name


def test_a_timed_backward_key_becomes_tokamax_s_vjp_from_its_residuals(monkeypatch) -> None:
    """A VJP key: the residuals (``[batch, heads, seq]``), the output and its cotangent, q, k
    and v, in that order; plain as the forward's; kind attention backward; never fitted on
    v7x (validation only)."""
    vjp = {"residuals": ["f32[4,16,4096]", "f32[4,16,4096]"], "out": "bf16[4,4096,16,128]",
           "dout": "bf16[4,4096,16,128]"}  # fmt: skip
    config = {"block_q_dkv": 1024, "block_kv_dkv": 1024, "block_kv_dkv_compute": 512}
    files = {"pallas_mosaic_tpu_flash_attention_vjp": {
        json.dumps(PLAIN | vjp | {"mask": CAUSAL_MASK}): {json.dumps(config): TIMES},
        json.dumps(PLAIN | vjp | {"logits_soft_cap": 30.0}): {json.dumps(config): TIMES},
    }}  # fmt: skip
    monkeypatch.setattr(tokamax_timings, "data_file", lambda g, op: files.get(op, {}))
    monkeypatch.setattr(tokamax_timings, "source", lambda g, op: f"{g} {op}")
    (point,) = tokamax_timings.points("v7x")
    assert point.kind == calibration.ATTENTION_BACKWARD and point.role == "validate"
    assert point.program.function.endswith(":tokamax_flash_attention_vjp")
    assert [a.shape for a in point.program.args] == [(4, 16, 4096)] * 2 + [(4, 4096, 16, 128)] * 5
    assert [a.dtype for a in point.program.args[:3]] == ["float32", "float32", "bfloat16"]
    kwargs = dict(point.program.kwargs)
    assert json.loads(kwargs["config"]) == config and kwargs["causal"] is True
    assert "backward" in point.name and "blocks 1024/1024/512" in point.name


def test_half_the_keys_are_fitted_by_their_hash_and_none_of_v7x() -> None:
    keys = [_key(q=f"bf16[{b},{n},16,128]") for b in range(1, 9) for n in (512, 1024, 2048)]
    fitted = [tokamax_timings.fitted("v6e", k) for k in keys]
    assert fitted == [tokamax_timings.fitted("v5p", k) for k in keys]  # the key alone decides
    assert 0.25 < sum(fitted) / len(keys) < 0.75
    assert not any(tokamax_timings.fitted("v7x", k) for k in keys)


def test_v5e_keeps_its_own_sources_and_fit(monkeypatch) -> None:
    monkeypatch.setattr(tokamax_timings, "data_file", lambda g, op: {})
    v5e = calibration_points.all_points("v5e")
    assert {p.name for p in calibration_points.matmul_guide_points()} <= {p.name for p in v5e}
    assert calibration_points.all_points("v6e") == []  # no tokamax data: no v6e point
