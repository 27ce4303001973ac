"""The serving-step matrix view: one line per kv-head share and mix, one cell per page size,
from the rows' records against the references."""

from __future__ import annotations

import dataclasses

from pallas_flash_bench.kernels.against_references import compare
from pallas_flash_bench.kernels.sweeps import serving_step, step_sweep, window_sweep
from pallas_flash_bench.views import steps_report


def _row(subject: str, workload, seconds: float, kind: str = "backend") -> dict:
    figures = {"latency_seconds": {"value": seconds, "source": "static"},
               "calibrated_latency_seconds": {"value": seconds, "band": 0.1}}  # fmt: skip
    estimates = {name: {"latency_seconds": seconds} for name in ("schedule", "mxu")}
    return {"subject": subject, "kind": kind, "config": "", "workload": workload.to_json(),
            "figures": figures, "estimates": estimates}  # fmt: skip


def _compared(workload, ours: float, theirs: float) -> list[dict]:
    mine = _row("splitkv", workload, ours)
    rpa = _row("tpu-inference-rpa-v3", workload, theirs, kind="reference")
    mine["against_references"] = compare(mine, [rpa])
    return [mine, rpa]


def test_each_step_of_the_matrix_is_known_by_its_mix() -> None:
    mixes = {steps_report.mix_of(w) for w in step_sweep()}
    assert mixes == {"decode", "vllm-512", "vllm-2048"}
    assert steps_report.mix_of(serving_step("jetstream")) == "jetstream"


def test_the_matrix_puts_each_step_in_its_line_and_page_column() -> None:
    decode_64 = serving_step("decode", 4, 1, page_size=64)
    mixed_128 = serving_step("vllm-2048", 8, 2, page_size=128)
    rows = _compared(decode_64, 1.0e-4, 1.5e-4) + _compared(mixed_128, 2.0e-4, 1.0e-4)
    lines = steps_report.steps_table(rows)
    assert lines[0] == "## The serving-step matrix"
    assert "ahead on 1, behind on 1 of 2 steps" in lines[2]
    table = [line for line in lines if line.startswith("| 1 (4") or line.startswith("| 2 (8")]
    decode_line, mixed_line = table
    cells = [cell.strip() for cell in decode_line.strip("|").split("|")]
    assert cells[1].startswith("decode only")
    assert cells[2:] == ["—", "1.50x ±10%, ahead under 2 of 6, unknown under 4", "—"]
    cells = [cell.strip() for cell in mixed_line.strip("|").split("|")]
    assert cells[2:] == ["—", "—", "0.50x ±10%, behind under 2 of 6, unknown under 4"]


def test_rows_outside_the_matrix_or_without_a_reference_make_no_section() -> None:
    jetstream = serving_step("jetstream", 32, 32)  # a whole-model step, not one chip's share
    assert steps_report.steps_table(_compared(jetstream, 1.0e-4, 1.0e-4)) == []
    assert steps_report.steps_table([]) == []


def _windowed():
    return next(w for w in window_sweep() if w.sliding_window is not None)


def test_a_windowed_step_sits_beside_the_same_step_without_its_window() -> None:
    windowed = _windowed()
    whole = dataclasses.replace(windowed, sliding_window=None)
    # ours halves with the window and leads; RPA v3's falls to 0.8 of its whole step
    rows = _compared(windowed, 1.0e-4, 1.6e-4) + _compared(whole, 2.0e-4, 2.0e-4)
    lines = steps_report.windows_table(rows)
    assert lines[0] == "## Windowed layers"
    (line,) = [line for line in lines if line.startswith("| decode only")]
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[1] == str(windowed.sliding_window)
    assert cells[2:4] == ["0.1 ms", "0.16 ms"]
    assert cells[4].startswith("1.60x ±10%, ahead")
    assert cells[5:] == ["0.50x", "0.80x"]


def test_without_its_unwindowed_step_or_any_windowed_row_the_section_says_so_or_is_absent() -> None:
    windowed = _windowed()
    lines = steps_report.windows_table(_compared(windowed, 1.0e-4, 1.0e-4))
    (line,) = [line for line in lines if line.startswith("| decode only")]
    assert line.rstrip().endswith("| — | — |")
    assert steps_report.windows_table(_compared(step_sweep()[0], 1.0e-4, 1.0e-4)) == []
