"""The serving engine's step rows: the step each row compiles, what its kernels are charged
(`backend_kernels.occupancy`), its figures and its report table."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_flash_bench.kernels import backend_kernels, ragged_step
from pallas_flash_bench.models import model_figures, model_flops
from pallas_flash_bench.models.model_workloads import ENGINE, REFERENCES, engine_models
from pallas_flash_bench.views import model_report
from pallas_flash_bench.views.cells import num, percent
from pallas_flash_estimate import calibration
from pallas_flash_estimate.targets import TARGETS
from pallas_flash_llama.engine_step import token_buckets


def _row(name: str):
    return next(w for w in ENGINE if w.name == name)


def test_a_steady_state_step_decodes_every_slot_but_one_beside_a_prompt_chunk() -> None:
    """88 slots of 1024 + 1024: 87 decode (lengths 1025..2048, evenly) while one prompt is
    prefilled 87 tokens a step, so that a request starts every 1024 / 87 steps as one ends."""
    w = _row("engine llama-2-7b, maxtext settings")
    mix = w.engine_mix()
    assert (mix.batch, mix.prefill, mix.lengths) == (87, (1, 87), (1025, 2048))
    lengths = ragged_step.kv_lengths(mix)
    assert lengths[:87].min() == 1025 and lengths[:87].max() == 2048
    assert ragged_step.tokens(mix) == 174 and w.tokens == 87
    assert w.token_budget == w.engine_bucket == 174  # the scheduler makes the step, unpadded
    assert token_buckets(w.token_budget)[-1] == 174
    chip = w.engine_mix(8)
    assert (chip.q_heads, chip.kv_heads) == (32 // 8, 32 // 8)  # Llama-2-7B: 4 of 32 a chip


def test_vllm_rows_take_the_kernel_bench_s_mixed_steps() -> None:
    w = _row("engine llama-3-8b vllm-2048")
    mix = w.engine_mix(8)
    assert (mix.batch, mix.prefill, mix.q_heads, mix.kv_heads) == (128, (3, 640), 4, 1)
    assert w.engine_bucket == 2048 == w.token_budget
    assert [w.name for w in engine_models()] == [w.name for w in ENGINE]


def test_a_cached_prefix_is_not_prefilled_again() -> None:
    """128 slots of 1152-token prompts (1024 shared) and 128 new tokens: 127 decode while one
    prompt is prefilled; with the cache, only its 128 tokens of its own (127 a step, after the
    1024 cached), without, the whole prompt (1143 a step)."""
    cached = _row("engine llama-3-8b shared prefix, cached").engine_mix()
    uncached = _row("engine llama-3-8b shared prefix, no caching").engine_mix()
    assert (
        (cached.batch, cached.lengths) == (uncached.batch, uncached.lengths) == (127, (1153, 1280))
    )
    assert (cached.prefill, cached.prefill_context) == ((1, 127), 1024)
    assert (uncached.prefill, uncached.prefill_context) == ((1, 1143), 4)
    assert ragged_step.tokens(cached) == 254 and ragged_step.tokens(uncached) == 1270


def test_the_ragged_calls_read_their_own_sequences_pages_and_the_write_its_items() -> None:
    w = _row("engine llama-3-8b vllm-512")
    mix, bucket = w.engine_mix(8), w.engine_bucket
    of = backend_kernels.occupancy("splitkv", mix, bucket)
    pages = np.ceil(ragged_step.kv_lengths(mix) / mix.page_size)
    decode = of("pallas_flash_ragged_paged_attention_decode.3")
    other = of("pallas_flash_ragged_paged_attention.7")
    assert decode.copied == pytest.approx(pages[: mix.batch].sum() / mix.num_pages)
    assert other.copied == pytest.approx(pages[mix.batch :].sum() / mix.num_pages)
    assert decode.copied + other.copied == pytest.approx(1.0)  # the pool: the pages used
    assert decode.loop_trips[0] > 0 and other.loop_trips[0] > 0
    write = of("pallas_flash_write_pages.1")
    # groups of chunk items, then per item; the same for the pages a prompt chunk fills
    assert write.copied is None and len(write.loop_trips) == 8
    assert write.loop_trips[4] > 0 and write.loop_trips[5] > 0
    assert of("some_other_kernel").loop_trips is None


def _engine_program(step: float) -> dict:
    estimate = {
        "compute_seconds": step, "compute_seconds_copies_overlapped": step,
        "async_copy_seconds": 0.0,
        "seconds_by_kind": {"kernel": step / 2, "matmul": step / 4, "other": step / 4},
        "memory_bound_seconds": step / 4, "collective_seconds": 0.0,
        "step_seconds_overlapped": step, "step_seconds_exposed": step,
        "step_seconds_scheduled": step, "ops": 10, "loop_trips": {},
        "undetermined_loops": [], "ops_with_unknown_inner_loops": [], "collectives": [],
        "kernel_grid_steps": 1000, "kernel_fill_seconds": 0.0, "kernel_undecided_seconds": 0.0,
    }  # fmt: skip
    hbm = {"argument": 9 << 30, "output": 8 << 30, "alias": 8 << 30, "temp": 0, "peak": 9 << 30}
    return {"program": "step", "compiled": True, "error": None, "hbm": hbm,
            "estimate": estimate, "notes": [], "compile_seconds": 170.0}  # fmt: skip


def test_an_engine_row_s_figures_and_table() -> None:
    """Tokens/s: one token per decoding sequence a step; MFU from the step's real tokens;
    held against the serving row's measurement and, at MaxText's settings, MaxText's own
    engine under the same estimator."""
    w = _row("engine llama-2-7b, maxtext settings")
    row = {"workload": w.to_json(), "programs": [_engine_program(0.02)], "error": None}
    row["figures"] = f = model_figures.derive(row, TARGETS["v5e-8"], 1.2)
    assert f["step_seconds"]["scheduled"] == pytest.approx(0.02)
    assert f["tokens_per_second"]["scheduled"] == pytest.approx(87 / 0.02)
    flops = model_flops.engine_step_flops(w.config, w.engine_mix())
    assert f["mfu"]["scheduled"] == pytest.approx(flops / 0.02 / (8 * 197e12))
    assert f["reference"]["value"] == REFERENCES["serve llama-2-7b, maxtext settings"].value
    committed = calibration.load("v5e")["coefficients"]
    features = calibration.ProgramFeatures.of_estimate(row["programs"][0]["estimate"])
    assert f["calibrated"]["step_seconds"] == pytest.approx(
        calibration.device_seconds(features, committed)
    )
    text = "\n".join(model_report.engine_table([row]))
    assert "## The serving engine's steps (v5e-8)" in text
    assert "174 of 174" in text and "4350" in text  # the bucket; 87 tokens / 20 ms
    band = percent(f["calibrated"]["band"])
    assert f"{num(f['calibrated']['tokens_per_second'])} ±{band}" in text
    assert "steady state, 1024 / 1024: ragged T=174" in text and "2048 evenly" in text
    if f["reference_program"] is not None:  # MaxText's engine, committed
        theirs = f["reference_program"]["tokens_per_second"]["scheduled"]
        ratio = f["against_reference_program"]["tokens_per_second"]["ratio"]["scheduled"]
        assert ratio == pytest.approx(87 / 0.02 / theirs)
    assert model_report.engine_table([]) == []


def test_engine_step_flops_count_the_new_tokens_and_their_visible_pairs() -> None:
    w = _row("engine llama-3-8b vllm-512")
    mix = w.engine_mix()
    c = w.config
    expected = 2 * model_flops.matmul_weights(c) * 512
    expected += 4 * c.q_heads * c.head_dim * ragged_step.visible_pairs(mix) * c.layers
    assert model_flops.engine_step_flops(c, mix) == pytest.approx(expected)


def test_the_serving_sweep_holds_the_engine_s_attention_on_one_chip_against_rpa_v3() -> None:
    """``--serving`` adds each steady-state engine row's attention at one chip's heads as a
    kernel row (where RPA v3 runs it too)."""
    from pallas_flash_bench import cli

    steps = cli._engine_attention()
    assert [(w.q_heads, w.kv_heads, w.batch, w.prefill) for w in steps] == [
        (4, 4, 87, (1, 87)), (4, 4, 95, (1, 95)), (4, 1, 127, (1, 127)),
        (4, 1, 127, (1, 127)), (4, 1, 127, (1, 1143))]  # fmt: skip
    assert all(w.op == "ragged" and w.even_lengths for w in steps)
