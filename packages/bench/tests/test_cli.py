"""End to end: ``pallas-flash bench`` and ``inspect`` on a tiny sweep, for v5e, without a TPU.

These compile for real with libtpu (skipped where it is not installed) in worker processes.
"""

from __future__ import annotations

import json
import subprocess

import pytest

import pallas_flash as pf
from pallas_flash_bench import aot, cli
from pallas_flash_bench.kernels.references import all_subjects
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_bench.runs import runner, worker
from pallas_flash_estimate.aot.devices import libtpu_version
from pallas_flash_estimate.targets import TARGETS

needs_libtpu = pytest.mark.skipif(libtpu_version() is None, reason="libtpu is not installed")

TINY = ["--quick", "--ops", "forward", "--seq-lens", "1024", "--backends", "xla", "--no-measure"]
"""The quick sweep's forward rows (plain and causal) at 1,024 tokens on the xla backend."""


def _static(results: dict) -> list:
    """What must not change between runs: everything but the date and wall-clock figures."""
    rows = []
    for row in results["rows"]:
        figures = {k: v for k, v in row["figures"].items() if k != "measured_seconds"}
        rows.append({**row, "figures": figures})
    return [rows, results["fits"]]


@needs_libtpu
def test_bench_writes_the_report_its_figures_repeat_and_a_cached_run_compiles_nothing(
    tmp_path, monkeypatch
) -> None:
    """Run ``a`` compiles its rows into an empty cache (without the fit search), ``b`` reads
    them from it and adds the fit search, ``c`` is served from that cache without starting a
    compile worker: their static figures are equal. (``--no-cache``: the decoding test.)"""
    cache = ["--cache-dir", str(tmp_path / "cache")]
    for run, flags in (("a", [*cache, "--no-fit"]), ("b", cache), ("c", cache)):
        if run == "c":
            assert list((tmp_path / "cache").glob("*.json"))
            monkeypatch.setattr(subprocess, "Popen", _no_workers)
        assert cli.main(["bench", *TINY, *flags, "--out", str(tmp_path / run)]) == 0
    first, second, cached = (json.loads((tmp_path / r / "results.json").read_text()) for r in "abc")
    assert _static(second) == _static(cached)
    assert _static(first)[0] == _static(second)[0]  # the rows (a ran without the fit search)
    assert second["fits"][0]["longest_seq_len"] > 8192  # the XLA baseline's, from the compiler
    assert (tmp_path / "a" / "report.md").read_text().startswith("# Pallas-Flash benchmark: v5e-4")
    assert (tmp_path / "a" / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plain = [r for r in first["rows"] if r["label"] == "forward N=1024"]
    rows = {(r["subject"], r["config"]): r for r in plain}
    assert rows[("xla", "")]["compiled"] and rows[("xla", "")]["kernels"] == []
    flash = rows[("jax-flash", "blocks 512")]
    assert flash["kernels"][0]["name"].startswith("flash_attention")
    assert flash["kernels"][0]["cycles_from"] == "every predicated region decided"
    assert 0.3 < flash["figures"]["mfu"]["value"] < 1.0
    assert flash["figures"]["mfu"]["source"] == "static"


def _no_workers(*args, **kwargs):
    raise AssertionError("a cached run must not start a compile worker")


@needs_libtpu
@pytest.mark.skipif(
    "splitkv" not in {b.name for b in pf.list_backends()}, reason="splitkv is not installed"
)
def test_decoding_over_the_slice_compiles_one_quarter_per_chip(tmp_path) -> None:
    """On v5e-4 the sweep decodes on one chip and on four: the four-chip program holds a
    quarter of the cache per chip, exchanges only the partials, and its latency is one chip's
    quarter of the HBM time plus the modelled collectives."""
    args = ["bench", "--ops", "decode", "--seq-lens", "32768", "--backends", "splitkv",
            "--no-reference", "--no-measure", "--no-fit", "--no-cache",
            "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["workload"]["q_heads"], r["workload"]["chips"]): r for r in results["rows"]}
    assert set(rows) == {(16, 1), (16, 4), (32, 1), (32, 4)}
    one, four = rows[(32, 1)], rows[(32, 4)]
    assert one["collectives"] == []
    partials = 32 * (128 + 1) * 4  # a float32 output and log-sum-exp per query head
    assert four["collectives"] and all(c["bytes"] <= partials for c in four["collectives"])
    assert four["hbm"]["argument"] < one["hbm"]["argument"] / 3.9
    figures = four["figures"]
    assert figures["memory_seconds"]["value"] == pytest.approx(  # + small partials' copies
        one["figures"]["memory_seconds"]["value"] / 4, rel=1e-3
    )
    target = TARGETS["v5e-4"]
    assert figures["collective_seconds"]["value"] >= len(four["collectives"]) * (
        target.collective_latency
    )
    assert figures["latency_seconds"] == {
        "value": pytest.approx(
            max(figures["compute_seconds"]["value"], figures["memory_seconds"]["value"])
            + figures["collective_seconds"]["value"]
        ),
        "source": "model",
    }
    assert "decode L=32768 H32/8 on 4 chips" in (tmp_path / "report.md").read_text()


def test_missing_libtpu_gives_a_clear_message_not_a_crash(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(runner, "libtpu_version", lambda: None)
    assert cli.main(["bench", *TINY, "--no-cache", "--out", str(tmp_path)]) == 0
    assert "libtpu is not installed" in capsys.readouterr().err
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["rows"] and all(not r["compiled"] for r in results["rows"])
    assert all(r["error"] == "libtpu is not installed" for r in results["rows"])
    assert "libtpu is not installed" in (tmp_path / "report.md").read_text()


@needs_libtpu
def test_a_missing_dump_is_a_note_not_a_crash(tmp_path) -> None:
    subject = all_subjects("quick", ["xla"], True)["jax-flash[blocks 512]"]
    empty = tmp_path / "dump"
    row = worker.analyse_row(subject, Workload("forward", 1024), TARGETS["v5e-1"], empty)
    assert row["compiled"]
    assert row["kernels"] == []
    assert any(note.startswith("LLO dump missing") for note in row["notes"])


@needs_libtpu
def test_inspect_prints_the_kernel_schedule(capsys) -> None:
    args = ["inspect", "--backend", "jax-flash[blocks 512]", "--shape", "1x2x1024x128"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "flash_attention" in out
    assert "bundles/step" in out
    assert "custom-call" in out
    assert "none: no copy, transpose or pad" in out


def test_fit_search_bisects_to_the_step(monkeypatch) -> None:
    """The search doubles, then bisects; checked against a fake compiler with a known limit."""
    limit = 13_000

    class Memory:
        def __init__(self, n: int) -> None:
            self.temp_size_in_bytes = 0 if n <= limit else 1 << 40
            self.argument_size_in_bytes = self.output_size_in_bytes = 0

    class Compiled:
        def __init__(self, n: int) -> None:
            self.n = n

        def memory_analysis(self) -> Memory:
            return Memory(self.n)

    monkeypatch.setattr(aot, "compile_for", lambda fn, specs, target: Compiled(specs[0][0][2]))
    subject = all_subjects("quick", ["xla"], False)["xla"]
    result = worker.longest_fitting(subject, "forward", TARGETS["v5e-1"], runner.FIT_LIMIT, 256)
    assert result["longest_seq_len"] == 12_800  # the largest multiple of 256 <= 13,000


@needs_libtpu
def test_model_workloads_compile_and_are_estimated_as_whole_programs(tmp_path) -> None:
    """A tiny LLaMa's train step (fsdp over 4 chips) and serving run (tensor over 2) go
    through the worker: each program's scanned layers are counted per layer, its collectives
    modelled, and the report shows them."""
    pytest.importorskip("pallas_flash_llama")
    from pallas_flash_bench.models.model_workloads import ModelWorkload
    from pallas_flash_estimate.targets import DEFAULT_TARGET

    train = ModelWorkload("train tiny", "train", "tiny", "v5e-4", (1, 4, 1), 8, seq_len=256,
                          remat="save_qkv")  # fmt: skip
    serve = ModelWorkload("serve tiny", "serve", "tiny", "v5e-4", (1, 1, 2), 4, prompt_len=64,
                          generate_len=64)  # fmt: skip
    target = TARGETS[DEFAULT_TARGET]
    options = runner.BenchOptions(
        target=target, sweep="quick", workloads=[], models=[train, serve], context=[],
        backends=None,
        references=False, fit=False, measure=False, price_per_chip_hour=1.2,
        out_dir=tmp_path, cache=runner.ResultCache(None), workers=1,
    )  # fmt: skip
    results = runner.run(options)
    rows = {row["workload"]["name"]: row for row in results["models"]}
    trained = rows["train tiny"]
    (program,) = trained["programs"]
    assert program["compiled"], program["error"]
    estimate = program["estimate"]
    assert sorted(estimate["loop_trips"].values()) == [2, 2]  # forward and backward scans
    assert estimate["seconds_by_kind"]["kernel"] > 0  # the pallas kernels
    assert estimate["collectives"] and estimate["collective_seconds"] > 0
    # copies hidden as scheduled never make the compute shorter than its ops other than them
    copies, compute = estimate["async_copy_seconds"], estimate["compute_seconds"]
    assert compute - copies <= estimate["compute_seconds_copies_overlapped"] <= compute
    ends = [estimate[f"step_seconds_{end}"] for end in ("overlapped", "scheduled", "exposed")]
    assert ends == sorted(ends)
    f = trained["figures"]
    assert 0 < f["mfu"]["exposed"] < f["mfu"]["overlapped"] < 1
    served = rows["serve tiny"]
    assert [p["program"] for p in served["programs"]] == ["prefill", "insert", "decode"]
    assert all(p["compiled"] for p in served["programs"])
    # the insert writes the prefilled rows in place: the donated cache is not copied whole
    insert = next(p for p in served["programs"] if p["program"] == "insert")
    assert insert["hbm"]["alias"] > 0
    assert served["figures"]["tokens_per_second"]["overlapped"] > 0
    report = (tmp_path / "report.md").read_text()
    assert "## Training steps against MaxText (v5e)" in report and "train tiny" in report
    assert "## Serving against JetStream (v5e)" in report


def test_estimate_names_what_is_wrong_with_its_arguments() -> None:
    with pytest.raises(SystemExit, match="--kwarg: expected NAME=VALUE"):
        cli.main(["estimate", "pallas_flash_bench.calibration.calibration_programs:xla_matmul",
                  "--arg", "bf16[8,128]", "--kwarg", "bm"])  # fmt: skip
    with pytest.raises(SystemExit, match="has no attribute 'nope'"):
        cli.main(["estimate", "pallas_flash_bench.calibration.calibration_programs:nope"])
