"""Tests of the Markdown report: every section, formatting, sorting and missing values."""

from __future__ import annotations

import copy
import json
import pathlib
import re
from typing import Any

import pytest

from pallas_flash_bench.kernels import against_references, chip_scaling, row_figures
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_bench.views.report import render_report, write_report

SAMPLE = pathlib.Path(__file__).parent / "samples" / "results_small.json"


def _render(results: dict[str, Any]) -> str:
    """The report of ``results`` once its rows carry the records the runner adds to a run's
    rows (the views only format them), made again after a test changed a row."""
    rows = results.get("rows") or []
    against_references.annotate(rows)
    target = (results.get("meta") or {}).get("target") or {}
    chip_scaling.annotate(rows, target.get("hbm_bandwidth", 819e9))
    return render_report(results)


@pytest.fixture
def results() -> dict[str, Any]:
    return json.loads(SAMPLE.read_text(encoding="utf-8"))


@pytest.fixture
def report(results: dict[str, Any]) -> str:
    return _render(results)


def _section(report: str, title: str) -> str:
    """The text of the ``## title`` section, up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", report, re.M | re.S)
    assert match, f"no section {title!r}"
    return match.group(1)


def _table_rows(text: str) -> list[list[str]]:
    """Cells of every Markdown table line in ``text`` (escaped pipes stay inside a cell)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
            rows.append([cell.strip() for cell in cells])
    return rows


def _row_for(text: str, *needles: str) -> list[str]:
    matches = [r for r in _table_rows(text) if all(any(n == c for c in r) for n in needles)]
    assert len(matches) == 1, f"expected one row with {needles}, got {matches}"
    return matches[0]


def test_header_has_target_versions_run_and_sources(results: dict[str, Any], report: str) -> None:
    assert report.startswith("# Pallas-Flash benchmark: v5e-1\n")
    for text in (
        "197 TFLOP/s",
        "16 GiB at 819 GB/s",
        "1.5 GHz",
        "128 MiB",
        "jax 0.10.2",
        "libtpu 0.0.42.1",
        "pallas_flash 0.1.0",
        "2026-11-21",
        "Sweep: quick",
        "$1.20 per chip-hour (source: text)",
        "measured on CPU",
        "**v5e-1**, 1 chip",
    ):
        assert text in report, text
    results["meta"]["target"].update(name="v5e-4", chips=4)
    assert "**v5e-4**, a slice of 4 chips: a call runs on one" in _render(results)
    how = _section(report, "How to read this")
    for source in ("`static`", "`model`", "`compiler`", "`measured-cpu`", "`measured-tpu`"):
        assert source in how
    assert "DMA" in how and "upper bound" in how


def test_measured_on_null_says_nothing_was_measured(results: dict[str, Any]) -> None:
    results["meta"]["measured_on"] = None
    assert "nothing measured" in _render(results)


def test_sections_come_in_order(report: str) -> None:
    titles = re.findall(r"^##+ (.+)$", report, re.M)
    assert titles == [
        "Target",
        "Run",
        "How to read this",
        "Results",
        "Forward",
        "Forward + backward",
        "Decode",
        "Calibration",
        "Decoding one sequence",
        "Longest sequence that fits",
        "Kernel schedules",
        "Copy trap",
        "Notes",
    ]


def test_every_table_line_has_as_many_cells_as_its_header(report: str) -> None:
    tables = re.findall(r"((?:^\|.*\n)+)", report, re.M)
    assert len(tables) == 7  # three ops, decoding, fits, kernels, copies
    for table in tables:
        widths = {len(row) for row in _table_rows(table)}
        assert len(widths) == 1, table


def test_result_tables_have_the_columns(report: str) -> None:
    header = _table_rows(_section(report, "Results"))[0]
    assert header == [
        "Workload",
        "Subject",
        "Compiled",
        "HBM total (GiB)",
        "Fits HBM",
        "Copy trap",
        "Static cycles",
        "Est. latency",
        "MFU",
        "MFU range",
        "HBM BW use",
        "Tokens/s",
        "Tokens/$",
        "Measured",
    ]


def test_rows_sorted_by_seq_len_causal_then_subject(results: dict[str, Any]) -> None:
    extra = copy.deepcopy(results["rows"][0])  # xla forward N=4096 causal
    extra["workload"]["causal"] = False
    extra["label"] = "forward N=4096 full"
    extra["subject"] = "zzz"
    results["rows"].append(extra)
    forward = re.search(r"### Forward\n(.*?)###", _render(results), re.S).group(1)
    order = [(r[0], r[1]) for r in _table_rows(forward)[1:]]
    assert order == [
        ("forward N=1024", "jax_splash [reference]"),
        ("forward N=4096 full", "zzz"),
        ("forward N=4096 causal", "pallas_flash (blocks 512/512)"),
        ("forward N=4096 causal", "xla"),
    ]


def test_compiled_row_values_are_formatted_with_sources(report: str) -> None:
    row = _row_for(_section(report, "Results"), "forward N=4096 causal", "xla")
    assert row[2:5] == ["✓", "0.312", "✓"]
    assert row[5] == "32 MiB"  # two 16 MiB copies summed
    assert row[6] == "—"  # no kernels, no static cycles
    assert row[7] == "1.23 ms (model)"
    assert row[8] == "61.2 % (model)"
    assert row[9] == "—"  # no static estimates
    assert row[10] == "5.0 % (model)"
    assert row[11] == "3.4e6 (model)"
    assert row[12] == "1.02e10 (model)"
    assert row[13] == "—"  # no measured_seconds


def test_static_cycles_copy_none_and_fits(report: str) -> None:
    results_text = _section(report, "Results")
    pallas = _row_for(results_text, "forward N=4096 causal", "pallas_flash (blocks 512/512)")
    assert pallas[5] == "none"
    assert pallas[6] == "1.66e6"
    assert pallas[7] == "1.11 ms (static)"
    too_big = _row_for(results_text, "forward_backward N=8192 causal", "xla")
    assert too_big[3] == "18.2"
    assert too_big[4] == "✗"


def test_measured_value_shown_with_its_source(report: str) -> None:
    decode = _row_for(_section(report, "Results"), "decode N=4096", "xla")
    assert decode[13] == "2.5 ms (measured-cpu)"
    assert decode[7] == "0.041 ms (model)"


def test_failed_compile_shows_cross_error_excerpt_and_dashes(report: str) -> None:
    row = _row_for(_section(report, "Results"), "forward_backward N=32768 causal")
    assert row[2].startswith("✗ Mosaic failed to compile TPU kernel: Ran out of VMEM \\|")
    assert row[2].endswith("…")
    assert "traceback" not in row[2]  # only the first line
    assert len(row[2]) < 80
    assert row[3:] == ["—"] * 11


def test_fits_table(report: str) -> None:
    fits = _section(report, "Longest sequence that fits")
    assert _table_rows(fits)[0][:4] == ["Subject", "Op", "Longest seq_len", "Searched up to"]
    xla = _row_for(fits, "xla", "forward")
    assert xla[2:6] == ["12,288", "1,048,576", "15.8 GiB", "compiler"]
    assert xla[6] == "quadratic scores buffer"
    pallas = _row_for(fits, "pallas_flash", "forward")
    assert pallas[2] == "none fits"
    assert pallas[4] == "—"


def test_kernel_schedules_table(report: str) -> None:
    kernels = _section(report, "Kernel schedules")
    header = _table_rows(kernels)[0]
    for column in ("Kernel", "Bundles/step", "Steps", "Grid", "Predicated bundles", "MXU ops"):
        assert column in header
    for unit in ("MXU", "VALU", "EUP", "VLOAD", "VSTORE"):
        assert f"{unit} %" in header
    row = _row_for(kernels, "flash_attention.1")
    by_column = dict(zip(header, row, strict=True))
    assert by_column["Subject"] == "pallas_flash (blocks 512/512)"
    assert by_column["Bundles/step"] == "1,620"
    assert by_column["Steps"] == "1,024"
    assert by_column["Grid"] == "1x16x8x8"
    assert by_column["Predicated bundles"] == "300"
    assert by_column["MXU %"] == "61.0 %"
    assert by_column["VALU %"] == "40.0 %"
    assert by_column["MXU ops"] == "248"
    assert _row_for(kernels, "splash_mha_fwd")[header.index("Grid")] == "—"
    assert len(_table_rows(kernels)) == 3  # header + two kernels; kernel-less rows left out


def test_copy_trap_lists_each_copy(report: str) -> None:
    copies = _section(report, "Copy trap")
    row = _row_for(copies, "copy.2")
    assert row == [
        "xla",
        "forward N=4096 causal",
        "copy.2",
        "copy",
        "bf16[1,16,4096,128]",
        "16 MiB",
        "layout change of k before the dot",
    ]
    assert _row_for(copies, "transpose.7")[3] == "transpose"
    assert "No copy, transpose or pad around the kernels in the other 4 compiled rows" in copies


def test_copy_trap_says_none_when_no_copies(results: dict[str, Any]) -> None:
    for row in results["rows"]:
        row["copies"] = []
    report = _render(results)
    copies = _section(report, "Copy trap")
    assert "No copy, transpose or pad around the kernels." in copies
    assert "|" not in copies
    xla = _row_for(_section(report, "Results"), "forward N=4096 causal", "xla")
    assert xla[5] == "none"


def test_notes_from_meta_and_rows(report: str) -> None:
    notes = _section(report, "Notes")
    assert "- Compiled ahead of time for v5e on a machine without a TPU." in notes
    assert "- xla, forward N=4096 causal: XLA fuses softmax; no Pallas kernel" in notes
    assert "VMEM OOM at block 1024" in notes


def test_missing_figures_and_sparse_results_render(results: dict[str, Any]) -> None:
    row = results["rows"][0]
    del row["figures"]["mfu"]
    row["figures"]["tokens_per_second"] = None
    row["hbm"] = None
    report = _render({"meta": results["meta"], "rows": [row]})
    rendered = _row_for(_section(report, "Results"), "forward N=4096 causal", "xla")
    assert rendered[3] == rendered[4] == rendered[8] == rendered[11] == "—"
    assert "No search was run." in _section(report, "Longest sequence that fits")
    assert "No kernel schedules" in _section(report, "Kernel schedules")


def test_empty_results_render() -> None:
    report = _render({})
    assert report.startswith("# Pallas-Flash benchmark: unknown target")
    assert "No results." in report


def test_write_report_writes_the_rendered_text(
    results: dict[str, Any], tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "out" / "report.md"
    write_report(results, path)
    assert path.read_text(encoding="utf-8") == render_report(results)


def test_against_references_picks_the_fastest_reference(results: dict[str, Any]) -> None:
    (splash,) = [r for r in results["rows"] if r.get("kind") == "reference"]
    slower = copy.deepcopy(splash)
    slower["config"] = "blocks 512/512"
    slower["figures"]["latency_seconds"]["value"] = 0.0003
    mine = copy.deepcopy(splash)
    mine.update(subject="mine", kind="backend", config="")
    mine["figures"]["latency_seconds"]["value"] = 0.0001
    results["rows"] += [slower, mine]
    section = _section(_render(results), "Against jax's kernels")
    row = _row_for(section, "mine")
    assert row[4] == "jax_splash" and row[5] == "0.15 ms (static)" and row[7] == "1.50x"
    assert row[8] == "—"  # the sample has no no-overlap figures
    assert len(_table_rows(section)) == 2  # the header and the one backend row


def test_against_references_without_overlap_takes_the_least_serial_reference(
    results: dict[str, Any],
) -> None:
    (splash,) = [r for r in results["rows"] if r.get("kind") == "reference"]
    other = copy.deepcopy(splash)
    other["config"] = "blocks 512/512"
    mine = copy.deepcopy(splash)
    mine.update(subject="mine", kind="backend", config="")
    for row, serial in ((splash, 0.0006), (other, 0.0005), (mine, 0.0004)):
        row["figures"]["latency_no_overlap_seconds"] = {"value": serial, "source": "model"}
    results["rows"] += [other, mine]
    row = _row_for(_section(_render(results), "Against jax's kernels"), "mine")
    assert row[8] == "1.25x"


def _decode_row(chips: int, latency: float, memory: float, collectives: float) -> dict:
    workload = {"op": "decode", "seq_len": 131072, "causal": False, "batch": 1,
                "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16",
                "chips": chips}  # fmt: skip
    figures = {
        "latency_seconds": {"value": latency, "source": "model"},
        "memory_seconds": {"value": memory, "source": "model"},
        "collective_seconds": {"value": collectives, "source": "model"},
        "tokens_per_second": {"value": 1 / latency, "source": "model"},
        "tokens_per_dollar": {"value": 3600 / latency / (1.2 * chips), "source": "model"},
    }
    label = "decode L=131072 H32/8" + (f" on {chips} chips" if chips > 1 else "")
    return {"subject": "splitkv", "kind": "backend", "config": "", "workload": workload,
            "label": label, "compiled": True, "figures": figures}  # fmt: skip


def test_decoding_table_compares_chips_and_the_hbm_time(results: dict[str, Any]) -> None:
    results["meta"]["target"].update(ici_link_bandwidth=50e9, collective_latency=10e-6)
    results["rows"] += [
        _decode_row(1, 0.000656, 0.000656, 0.0),
        _decode_row(4, 0.000184, 0.000164, 0.0000205),
    ]
    section = _section(_render(results), "Decoding one sequence")
    assert "assumed 10 us" in section and "50 GB/s" in section
    one = _row_for(section, "decode L=131072 H32/8")
    assert one[2:6] == ["0.656 ms (model)", "1.00x", "none", "—"]
    four = _row_for(section, "decode L=131072 H32/8 on 4 chips")
    assert four[2:6] == ["0.184 ms (model)", "1.12x", "20.5 us", "3.57x"]
    assert four[6] == "5435 (model)"


def test_decoding_table_is_left_out_without_decode_rows(results: dict[str, Any]) -> None:
    results["rows"] = [r for r in results["rows"] if r["workload"]["op"] != "decode"]
    assert "## Decoding one sequence" not in _render(results)


def test_against_references_is_left_out_without_a_shared_workload(report: str) -> None:
    assert "## Against jax's kernels" not in report


# Static cycles of the pallas forward (4096 x 1024 blocks) and of splash (1024 / 1024) at
# N=4096, one kernel each, as the bench read them from one libtpu's dumps.
PALLAS_CYCLES = {"schedule": 1_074_041, "mxu": 1_048_576, "critical_path": 1_084_381,
                 "push8": 1_310_720, "push16": 1_572_864, "dma": 1_074_041}  # fmt: skip
SPLASH_CYCLES = {"schedule": 1_258_409, "mxu": 1_048_576, "critical_path": 1_116_085,
                 "push8": 1_258_409, "push16": 1_258_409, "dma": 1_258_409}  # fmt: skip


def _with_estimates(row: dict[str, Any], cycles: dict[str, int]) -> dict[str, Any]:
    from pallas_flash_estimate.targets import TARGETS

    target = TARGETS["v5e-1"]
    workload = Workload(**row["workload"])
    memory = workload.min_hbm_bytes / target.hbm_bandwidth
    row = copy.deepcopy(row)
    row["estimates"] = row_figures.spread(workload, target, cycles, memory, 0.0)
    headline = row["estimates"]["schedule"]
    row["figures"]["latency_seconds"] = {"value": headline["latency_seconds"], "source": "static"}
    row["figures"]["mfu"] = {"value": headline["mfu"], "source": "static"}
    row["mfu_range"] = row_figures.mfu_range(headline["mfu"], row["estimates"])
    row["kernels"] = [dict(k, step_seconds=row_figures.step_seconds(k, target))
                      for k in row["kernels"]]  # fmt: skip
    return row


@pytest.fixture
def spread_results(results: dict[str, Any]) -> dict[str, Any]:
    (splash,) = [r for r in results["rows"] if r.get("kind") == "reference"]
    splash["workload"]["seq_len"], splash["label"] = 4096, "forward N=4096"
    mine = copy.deepcopy(splash)
    mine.update(subject="pallas", kind="backend", config="")
    mine["kernels"][0].update(steps=64, cycles=1_074_041, pushes=4096, dma_bytes=64 << 20)
    results["rows"] = [_with_estimates(splash, SPLASH_CYCLES), _with_estimates(mine, PALLAS_CYCLES)]
    return results


def test_mfu_range_over_the_estimates(spread_results: dict[str, Any]) -> None:
    report = _render(spread_results)
    row = _row_for(_section(report, "Results"), "forward N=4096", "pallas")
    assert row[8] == "97.6 % (static)"
    # pushes at 16 cycles, not overlapped, to the headline (the MXU floor alone, 100 %, is one
    # of its parts, not a figure of its own)
    assert row[9] == "66.7 to 97.6 %"
    splash = _row_for(_section(_render(spread_results), "Results"), "jax_splash [reference]")
    assert splash[9] == "83.3 to 94.0 %"  # its critical path is shorter than its schedule


def test_spread_section_gives_the_mfu_under_each_estimate(spread_results: dict[str, Any]) -> None:
    section = _section(_render(spread_results), "How sure the estimates are")
    assert "No hardware measurement tells which is right" in section
    header = _table_rows(section)[0]
    assert header[2:] == [
        "MFU (headline)",
        "Schedule (bundles)",
        "MXU floor (matmuls)",
        "Critical path",
        "Pushes at 8, no overlap",
        "Pushes at 16, no overlap",
        "DMA bound",
    ]
    pallas = _row_for(section, "pallas")
    assert pallas[2:] == ["97.6 % (static)", "97.6 %", "100.0 %", "96.7 %", "80.0 %", "66.7 %",
                          "97.6 %"]  # fmt: skip
    splash = _row_for(section, "jax_splash [reference]")
    assert splash[5] == "94.0 %"  # splash's critical path beats its slot-bound schedule


def test_lead_says_which_estimates_it_rests_on(spread_results: dict[str, Any]) -> None:
    section = _section(_render(spread_results), "Against jax's kernels")
    assert _table_rows(section)[0][-1] == "Lead under every estimate?"
    lead = _row_for(section, "pallas")[-1]
    assert lead == (
        "the lead rests on weight pushes hidden under the matmuls: ahead under Schedule "
        "(bundles) 1.17x, Critical path 1.03x, DMA bound 1.17x; level under MXU floor "
        "(matmuls) 1.00x; behind under Pushes at 8, no overlap 0.96x, Pushes at 16, no overlap "
        "0.80x"
    )
    for row in spread_results["rows"]:
        if row["kind"] == "backend":
            row["estimates"]["push8"]["latency_seconds"] /= 2
            row["estimates"]["push16"]["latency_seconds"] /= 2
    lead = _row_for(_section(_render(spread_results), "Against jax's kernels"), "pallas")
    assert lead[-1].startswith("never behind: ahead under Schedule (bundles) 1.17x,")
    assert "; level under MXU floor (matmuls) 1.00x" in lead[-1]
    (pallas,) = [r for r in spread_results["rows"] if r["subject"] == "pallas"]
    references = [r for r in spread_results["rows"] if r["kind"] == "reference"]
    for name, figures in pallas["estimates"].items():  # within 0.5 % of the fastest reference
        theirs = [t for r in references if (t := r["estimates"][name]["latency_seconds"])]
        figures["latency_seconds"] = min(theirs) * 1.004 if theirs else None
    lead = _row_for(_section(_render(spread_results), "Against jax's kernels"), "pallas")
    assert lead[-1].startswith("level under every estimate (Schedule (bundles) 1.00x,")
    pallas["estimates"]["schedule"]["latency_seconds"] *= 2
    lead = _row_for(_section(_render(spread_results), "Against jax's kernels"), "pallas")
    assert lead[-1].startswith("never ahead: level under MXU floor (matmuls) 1.00x,")
    assert lead[-1].endswith("; behind under Schedule (bundles) 0.50x")
    for row in spread_results["rows"]:
        if row["kind"] == "backend":
            for figures in row["estimates"].values():
                figures["latency_seconds"] *= 10
    lead = _row_for(_section(_render(spread_results), "Against jax's kernels"), "pallas")
    assert lead[-1].startswith("behind under every estimate (Schedule (bundles) 0.05x,")


def test_kernel_table_sets_dma_per_step_against_compute(spread_results: dict[str, Any]) -> None:
    kernels = _section(_render(spread_results), "Kernel schedules")
    header = _table_rows(kernels)[0]
    row = dict(zip(header, _row_for(kernels, "pallas"), strict=True))
    assert row["Pushes"] == "4,096"
    assert row["Compute/step"] == "11.2 us"  # 1,074,041 cycles / 64 steps at 1.5 GHz
    assert row["DMA/step"] == "1.28 us"  # 1 MiB per step at 819 GB/s
    splash = dict(zip(header, _row_for(kernels, "jax_splash [reference]"), strict=True))
    assert splash["DMA/step"] == "—"


def test_the_readme_block_is_the_calibrated_comparison_of_one_run(
    spread_results: dict[str, Any],
) -> None:
    from pallas_flash_bench.views import comparison, readme

    for row in spread_results["rows"]:
        latency = row["figures"]["latency_seconds"]["value"]
        row["figures"]["calibrated_latency_seconds"] = {
            "value": 1.05 * latency, "source": "calibrated", "band": 0.08, "kind": "MXU-bound"
        }  # fmt: skip
    against_references.annotate(spread_results["rows"])
    block = readme.render_block(spread_results)
    assert block.startswith(readme.BEGIN) and block.rstrip().endswith(readme.END)
    assert "From one run of `pallas-flash bench --quick --target v5e-1` on 2026-11-21" in block
    assert "| " + " | ".join(comparison.HEADLINE_HEADER) + " |" in block
    (line,) = [x for x in block.splitlines() if x.startswith("| forward N=4096 | pallas")]
    assert "±8%" in line and "jax_splash" in line
    assert "## Results" not in block, "only the headline"


def test_a_reference_without_a_figure_makes_the_verdict_unknown_not_skipped(
    spread_results: dict[str, Any],
) -> None:
    """Under an estimate where a reference has no figure, the backend is not compared with
    the other references alone: the verdict under it is unknown."""
    from pallas_flash_bench.views.comparison import against_references_table

    splash = next(r for r in spread_results["rows"] if r.get("kind") == "reference")
    splash["estimates"]["critical_path"] = {"cycles": None, "latency_seconds": None, "mfu": None}
    against_references.annotate(spread_results["rows"])
    section = "\n".join(against_references_table(spread_results["rows"]))
    _, row = _table_rows(section)
    assert "unknown under Critical path" in row[-1]
    assert "Critical path 1." not in row[-1]


def test_a_lead_within_the_calibrated_band_is_level(spread_results: dict[str, Any]) -> None:
    from pallas_flash_bench.views.comparison import against_references_table

    for row in spread_results["rows"]:
        latency = row["figures"]["latency_seconds"]["value"]
        row["figures"]["calibrated_latency_seconds"] = {
            "value": latency, "source": "calibrated", "band": 0.5, "kind": "MXU-bound"
        }  # fmt: skip
    against_references.annotate(spread_results["rows"])
    _, row = _table_rows("\n".join(against_references_table(spread_results["rows"])))
    assert row[-1].startswith("level under every estimate"), row[-1]
    assert row[-2].endswith("±50%")
