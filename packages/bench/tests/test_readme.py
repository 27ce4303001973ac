"""The figures the README and the docs state: rendered again from the committed results files,
they must be what the files say, and the files must be of the code's analysis."""

from __future__ import annotations

import json
import pathlib

import pytest

from pallas_flash_bench.runs import runner
from pallas_flash_bench.views import readme
from pallas_flash_estimate import ANALYSIS_VERSION

ROOT = pathlib.Path(__file__).parents[3]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAIN_RUN = DOCS / "results" / "quick-v5e-4.json"
MODELS_RUN = DOCS / "results" / "models-v5e.json"
CONTEXT_RUN = DOCS / "results" / "context-v5e.json"
NEWEST_RUN = DOCS / "results" / "quick-v5e-4-newest.json"
SERVING_RUN = DOCS / "results" / "serving-ragged-v5e-4.json"
STEPS_RUN = DOCS / "results" / "serving-steps-v5e-4.json"
WINDOWS_RUN = DOCS / "results" / "serving-windows-v5e-4.json"

if not (ROOT / "mkdocs.yml").exists():
    pytest.skip("not run from the repository: no README to check", allow_module_level=True)

RERUN = (
    "rerun `pallas-flash readme` (and, for a new analysis, the bench: docs/benchmarks.md, "
    "'Regenerating the figures')"
)


def _block(text: str, begin: str, end: str) -> str:
    start, stop = text.index(begin), text.index(end)
    return text[start : stop + len(end)] + "\n"


def test_replacing_the_block_keeps_the_rest() -> None:
    text = f"# Title\n\nbefore\n\n{readme.BEGIN}\nold\n{readme.END}\n\nafter\n"
    new = f"{readme.BEGIN}\nnew\n{readme.END}\n"
    assert readme.replace_block(text, new) == f"# Title\n\nbefore\n\n{new}\nafter\n"
    with pytest.raises(ValueError, match="expected the markers"):
        readme.replace_block("no markers here", new)


def _made_by_this_analysis(results: dict, *, rows: bool) -> bool:
    """Whether a committed run was made by the estimator's analysis of this code and, for a
    run with kernel rows, by its row format."""
    versions = results["meta"]["versions"]
    same = versions.get("analysis") == str(ANALYSIS_VERSION)
    return same and (not rows or versions.get("row_format") == str(runner.ROW_FORMAT))


def test_the_readme_and_the_report_page_state_the_committed_main_run() -> None:
    results = json.loads(MAIN_RUN.read_text())
    assert _made_by_this_analysis(results, rows=True), RERUN
    block = _block(README.read_text(), readme.BEGIN, readme.END)
    assert block == readme.render_block(results), RERUN
    assert (DOCS / readme.REPORT_PAGE).read_text() == readme.render_report_page(results), RERUN


def test_the_models_page_states_the_committed_models_run() -> None:
    results = json.loads(MODELS_RUN.read_text())
    assert _made_by_this_analysis(results, rows=False), RERUN
    assert (DOCS / readme.MODELS_PAGE).read_text() == readme.render_models_page(results), RERUN


def test_the_context_page_states_the_committed_context_run() -> None:
    results = json.loads(CONTEXT_RUN.read_text())
    assert _made_by_this_analysis(results, rows=False), RERUN
    assert (DOCS / readme.CONTEXT_PAGE).read_text() == readme.render_context_page(results), RERUN


def test_the_serving_page_states_the_committed_mixed_steps_run() -> None:
    """The mixed serving steps against RPA v3: every row a ragged step, of this analysis."""
    results = json.loads(SERVING_RUN.read_text())
    assert _made_by_this_analysis(results, rows=True), RERUN
    assert {row["workload"]["op"] for row in results["rows"]} == {"ragged"}
    assert any(row["subject"].startswith("tpu-inference-rpa") for row in results["rows"])
    page = (DOCS / readme.SERVING_PAGE).read_text()
    assert page == readme.render_serving_page(results), RERUN


def _rows_against_rpa(run: pathlib.Path, sweep: list) -> dict:
    """The committed run ``run``, checked: of this analysis, RPA v3 at its widest block search,
    our row and RPA v3's compiled for every step of ``sweep``."""
    results = json.loads(run.read_text())
    assert _made_by_this_analysis(results, rows=True), RERUN
    assert results["meta"]["sweep"] == "default"  # RPA v3's widest block search
    steps = {json.dumps(w.to_json(), sort_keys=True) for w in sweep}
    for subject in ("splitkv", "tpu-inference-rpa-v3"):
        rows = [r for r in results["rows"] if r["subject"] == subject and r.get("compiled")]
        assert {json.dumps(r["workload"], sort_keys=True) for r in rows} == steps, subject
    return results


def test_the_windows_page_states_the_committed_windowed_steps_run() -> None:
    """The windowed layers' steps against RPA v3 at its widest search: every step, windowed
    or not, has our row and RPA v3's, of this analysis."""
    from pallas_flash_bench.kernels.sweeps import window_sweep

    results = _rows_against_rpa(WINDOWS_RUN, window_sweep())
    page = (DOCS / readme.WINDOWS_PAGE).read_text()
    assert page == readme.render_windows_page(results), RERUN
    assert "## Windowed layers" in page


def test_the_steps_page_states_the_committed_step_matrix_run() -> None:
    """The serving-step matrix against RPA v3 at its widest search: every step of the matrix
    has our row and RPA v3's, of this analysis."""
    from pallas_flash_bench.kernels.sweeps import step_sweep

    results = _rows_against_rpa(STEPS_RUN, step_sweep())
    page = (DOCS / readme.STEPS_PAGE).read_text()
    assert page == readme.render_steps_page(results), RERUN


def test_a_models_run_rewrites_its_page_and_leaves_the_readme_alone(tmp_path) -> None:
    text = f"{readme.BEGIN}\nmain\n{readme.END}\n"
    path = tmp_path / "README.md"
    path.write_text(text)
    models = {"meta": {"date": "2026-11-25", "versions": {"jax": "0.10.2"}}, "models": []}
    readme.update(path, None, models, tmp_path)
    assert path.read_text() == text
    page = (tmp_path / readme.MODELS_PAGE).read_text()
    assert page.startswith("# Model-level figures")
    assert "From one run of `pallas-flash bench --models` on 2026-11-25 (jax 0.10.2" in page


def test_the_stacks_page_states_the_committed_runs_of_both_stacks() -> None:
    """The stacks page is the main run beside the same sweep on the newest stack, whose file
    names the newest stack's jax (constraints-newest.txt)."""
    pinned, newest = (json.loads(path.read_text()) for path in (MAIN_RUN, NEWEST_RUN))
    assert _made_by_this_analysis(newest, rows=True), RERUN
    assert newest["meta"]["sweep"] == pinned["meta"]["sweep"], RERUN
    assert newest["meta"]["target"] == pinned["meta"]["target"], RERUN
    pins = dict(
        line.split("==")
        for line in (ROOT / "constraints-newest.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert newest["meta"]["versions"]["jax"] == pins["jax"], RERUN
    page = (DOCS / readme.STACKS_PAGE).read_text()
    assert page == readme.render_stacks_page(pinned, newest), RERUN
