"""Model flops as MaxText counts them, a model workload's figures and its report sections."""

from __future__ import annotations

import sys

import pytest

from pallas_flash_bench.models import model_figures, model_flops
from pallas_flash_bench.models.model_workloads import (
    MAXTEXT_16B,
    ModelWorkload,
    ablation,
    ablation_steps,
    default_models,
    quick_models,
)
from pallas_flash_bench.views import model_report
from pallas_flash_bench.views.cells import percent
from pallas_flash_estimate import calibration
from pallas_flash_estimate.targets import SENSITIVITY, TARGETS


def test_maxtext_16b_has_maxtext_s_shape() -> None:
    # global_parameter_scale=16: 15.8 B parameters
    assert MAXTEXT_16B.num_params == pytest.approx(15.8e9, rel=0.01)


def test_train_flops_count_matmuls_three_times_and_causal_attention_half() -> None:
    c = MAXTEXT_16B
    batch, seq = 6, 2048
    weights = c.layers * (c.hidden * c.head_dim * 4 * c.q_heads + 3 * c.hidden * c.mlp)
    weights += c.hidden * c.vocab  # the logits; the input lookup is no matmul
    assert model_flops.matmul_weights(c) == weights
    attention = 4 * batch * seq * seq * c.q_heads * c.head_dim * c.layers / 2
    expected = 3 * (2 * weights * batch * seq + attention)
    assert model_flops.train_step_flops(c, batch, seq) == pytest.approx(expected)
    # about 6 x params x tokens
    assert expected / (6 * c.num_params * batch * seq) == pytest.approx(1.03, abs=0.01)


def test_decode_flops_per_token() -> None:
    c = MAXTEXT_16B
    per_token = 2 * model_flops.matmul_weights(c) + 4 * 1000 * c.q_heads * c.head_dim * c.layers
    assert model_flops.decode_step_flops(c, 3, 1000) == pytest.approx(3 * per_token)


def _program(name: str, compute: float, collectives: float, peak: int) -> dict:
    estimate = {
        "compute_seconds": compute,
        "compute_seconds_copies_overlapped": compute,
        "async_copy_seconds": 0.0,
        "seconds_by_kind": {"kernel": compute / 4, "matmul": compute / 2, "other": compute / 4},
        "memory_bound_seconds": compute / 8,
        "collective_seconds": collectives,
        "step_seconds_overlapped": max(compute, collectives),
        "step_seconds_exposed": compute + collectives,
        "step_seconds_scheduled": compute + collectives / 2,
        "ops": 10,
        "loop_trips": {"while.1": 32},
        "undetermined_loops": [],
        "ops_with_unknown_inner_loops": [],
        "collectives": [
            {
                "name": "ag",
                "opcode": "all-gather",
                "bytes": 1,
                "group": 8,
                "runs": 32,
                "seconds": collectives,
            }
        ],
    }
    hbm = {"argument": peak, "output": peak, "alias": peak, "temp": 0, "peak": peak}
    return {"program": name, "compiled": True, "error": None, "hbm": hbm,
            "estimate": estimate, "notes": [], "compile_seconds": 60.0}  # fmt: skip


def test_train_figures_at_both_ends_against_maxtext() -> None:
    w = default_models()[0]
    assert w.name == "train maxtext-16b" and w.chips == 256
    result = {"workload": w.to_json(), "programs": [_program("train", 3.0, 1.0, 10 << 30)]}
    f = model_figures.derive(result, TARGETS["v5e-256"], 1.2)
    flops = model_flops.train_step_flops(w.config, w.batch, w.seq_len)
    assert f["step_seconds"] == {"overlapped": 3.0, "scheduled": 3.5, "exposed": 4.0}
    assert f["mfu"]["overlapped"] == pytest.approx(flops / 3.0 / (256 * 197e12))
    assert f["tokens_per_chip_second"]["exposed"] == pytest.approx(w.batch * 2048 / 4.0 / 256)
    ratio = model_figures.against_reference(f)
    assert ratio["overlapped"] == pytest.approx(f["mfu"]["overlapped"] / 0.611)
    assert f["fits"] and f["peak_hbm"] == 10 << 30
    assert f["peak_hbm_share"] == pytest.approx(10 / 16)


def test_serving_figures_charge_prefill_and_every_decode_step() -> None:
    w = next(w for w in default_models() if w.name == "serve llama-2-7b int8")
    programs = [_program("prefill", 0.8, 0.0, 1 << 30), _program("insert", 0.1, 0.0, 1 << 30),
                _program("decode", 0.01, 0.002, 2 << 30)]  # fmt: skip
    f = model_figures.derive({"workload": w.to_json(), "programs": programs}, TARGETS["v5e-8"], 1.2)
    assert w.prefill_calls == 12  # 96 prompts, 8 a step, each step's caches inserted
    total = 12 * (0.8 + 0.1) + 1024 * 0.012
    assert f["step_seconds"]["exposed"] == pytest.approx(total)
    scheduled = 12 * (0.8 + 0.1) + 1024 * 0.011
    assert f["tokens_per_second"]["scheduled"] == pytest.approx(96 * 1024 / scheduled)
    assert f["tokens_per_second"]["exposed"] == pytest.approx(96 * 1024 / total)
    assert f["tokens_per_dollar"]["exposed"] == pytest.approx(96 * 1024 / total / (8 * 1.2 / 3600))
    assert f["peak_hbm"] == 2 << 30


def test_a_program_out_of_memory_gives_what_it_needed() -> None:
    w = ablation()[0][1]
    failed = {"program": "train", "compiled": False, "error": "RESOURCE_EXHAUSTED: ...",
              "hbm": None, "estimate": None, "notes": [], "needed_bytes": 40 << 30}  # fmt: skip
    row = {"workload": w.to_json(), "programs": [failed], "error": None}
    row["figures"] = model_figures.derive(row, TARGETS["v5e-256"], 1.2)
    assert not row["figures"]["fits"] and row["figures"]["mfu"]["overlapped"] is None
    text = "\n".join(model_report.model_sections({"models": [row], "ablation": ablation_steps()}))
    assert "does not fit: needs 40 GiB" in text


def test_the_model_sections_render_without_the_llama_package(monkeypatch) -> None:
    """A view renders what results.json holds (the ablation's order too): it imports neither
    the LLaMa package nor the workloads built on it."""
    w = ablation()[1][1]
    row = {"workload": w.to_json(), "programs": [_program("train", 3.0, 1.0, 10 << 30)],
           "error": None}  # fmt: skip
    row["figures"] = model_figures.derive(row, TARGETS[w.target], 1.2)
    results = {"models": [row], "ablation": ablation_steps()}
    for module in ("pallas_flash_llama", "pallas_flash_bench.models.model_workloads"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it raises
    text = "\n".join(model_report.model_sections(results))
    assert "## What each optimisation buys (Llama-2-7B)" in text
    assert "| bfloat16 compute |" in text


def test_report_sections_show_ours_beside_the_reference() -> None:
    rows = []
    for w, programs in (
        (default_models()[0], [_program("train", 3.0, 1.0, 10 << 30)]),
        (default_models()[3], [_program("prefill", 0.8, 0, 1 << 30),
                               _program("insert", 0.1, 0, 1 << 30),
                               _program("decode", 0.01, 0.002, 2 << 30)]),
    ):  # fmt: skip
        row = {"workload": w.to_json(), "programs": programs, "error": None}
        row["figures"] = model_figures.derive(row, TARGETS[w.target], 1.2)
        rows.append(row)
    text = "\n".join(model_report.model_sections({"models": rows}))
    assert "## Training steps against MaxText (v5e)" in text
    assert "61.1 % (MaxText README (v5e-256, measured))" in text
    assert "## Serving against JetStream (v5e)" in text and "3663 tok/s" in text
    assert "## What the model estimates are made of" in text
    assert "3.5 s (3 s .. 4 s)" in text  # the breakdown: scheduled (hidden .. exposed)
    assert "4 s (as scheduled 3.5 s; all hidden 3 s)" in text  # the headline: nothing hidden
    assert model_report.model_sections({"models": []}) == []


def test_the_quick_sweep_has_one_small_model_row() -> None:
    (row,) = quick_models()
    assert row.target == "v5e-4" and row.model == "llama-3.2-1b"
    names = [w.name for w in default_models()]
    assert len(names) == len(set(names))
    assert ModelWorkload(**row.to_json()) == row


def test_model_rows_move_with_each_assumed_constant_and_carry_their_calibrated_step() -> None:
    w = default_models()[0]
    program = _program("train", 3.0, 1.0, 10 << 30)
    program["estimate"].update(kernel_grid_steps=1000, kernel_fill_seconds=0.0,
                               kernel_undecided_seconds=0.0)  # fmt: skip
    program["estimate"]["sensitivity"] = {
        name: {"overlapped": 3.0, "scheduled": 3.5 + i, "exposed": 4.0 + i}
        for i, name in enumerate(SENSITIVITY)
    }
    row = {"workload": w.to_json(), "programs": [program], "error": None}
    row["figures"] = f = model_figures.derive(row, TARGETS["v5e-256"], 1.2)
    flops = model_flops.train_step_flops(w.config, w.batch, w.seq_len)
    peak = 256 * 197e12
    for i, name in enumerate(SENSITIVITY):
        assert f["sensitivity"][name]["mfu"] == pytest.approx(flops / (3.5 + i) / peak)
    committed = calibration.load("v5e")["coefficients"]
    features = calibration.ProgramFeatures.of_estimate(program["estimate"])
    calibrated = calibration.device_seconds(features, committed)
    assert f["calibrated"]["step_seconds"] == pytest.approx(calibrated)
    assert f["calibrated"]["mfu"] == pytest.approx(flops / calibrated / peak)
    text = "\n".join(model_report.sensitivity_table([row]))
    assert "| ICI bandwidth x0.7 | collective latency x3 | HBM at 90 % |" in text
    assert percent(flops / 5.5 / peak) in text  # the third constant moved


def test_the_row_at_maxtext_settings_is_held_against_maxtext_s_engine() -> None:
    """The serving row at JetStream-MaxText's settings gets MaxText's engine programs, estimated
    by the same estimator (committed), and the report a verdict under the row's band."""
    from pallas_flash_bench.models import maxtext_serving

    committed = maxtext_serving.committed("llama2-7b")
    if committed is None:
        pytest.skip("no committed MaxText serving analysis")
    w = next(w for w in default_models() if w.name in model_figures.REFERENCE_SERVING)
    assert (w.batch, w.prefill_batch, w.kv_dtype, w.mesh) == (88, 1, None, (1, 1, 8))
    assert w.batch == committed["batch"]
    programs = [_program("prefill", 0.02, 0.0, 1 << 30), _program("insert", 0.002, 0.0, 1 << 30),
                _program("decode", 0.01, 0.002, 2 << 30)]  # fmt: skip
    for program in programs:  # what the calibration reads of each
        program["estimate"].update(kernel_grid_steps=100, kernel_fill_seconds=0.0)
    row = {"workload": w.to_json(), "programs": programs, "error": None}
    row["figures"] = f = model_figures.derive(row, TARGETS["v5e-8"], 1.2)
    assert f["reference_program"]["tokens_per_second"] == committed["tokens_per_second"]
    text = "\n".join(model_report.serving_table([row]))
    theirs = committed["tokens_per_second"]["exposed"]
    ours = f["tokens_per_second"]["exposed"]
    against = f["against_reference_program"]["tokens_per_second"]
    assert against["ratio"]["exposed"] == pytest.approx(ours / theirs)
    assert f"{ours / theirs:.3g}x" in text
    # the committed calibration's serving point gives the row its band, and the verdict
    assert f["calibrated"]["kinds"] == ["serving run"]
    band = f["calibrated"]["band"]
    verdict = "ahead" if ours / theirs > 1 + band else "behind" if ours / theirs < 1 - band else ""
    assert f"{verdict or 'level'} (band ±" in text
    assert against["verdict"] == (verdict or "level")
