"""The calibration: its fit, its kinds and bands, the published points, and the committed
calibration the reports and docs use."""

from __future__ import annotations

import math
import pathlib

import pytest

from pallas_flash_bench.calibration import calibration_points, tokamax_timings
from pallas_flash_bench.views import calibration_report, readme
from pallas_flash_estimate import calibration
from pallas_flash_estimate.program import whole_program

DOCS_PAGE = pathlib.Path(__file__).parents[3] / "docs" / "calibration.md"

TRUE = {"static_factor": 1.05, "step_seconds": 0.3e-6, "fill_factor": 1.0,
        "host_call_seconds": 1e-4}  # fmt: skip


def _program(static: float, steps: float = 0.0, fill: float = 0.0, **kw) -> dict:
    return {"step_seconds_scheduled": static, "kernel_grid_steps": steps,
            "kernel_fill_seconds": fill, "memory_bound_seconds": kw.get("memory", 0.0),
            "kernel_undecided_seconds": kw.get("undecided", 0.0)}  # fmt: skip


def _point(name: str, estimate: dict, role: str, timing: str = "device") -> dict:
    f = calibration.ProgramFeatures.of_estimate(estimate)
    measured = calibration.predicted_seconds(f.values(timing == "host"), TRUE)
    return {"point": {"name": name, "role": role, "timing": timing, "source": "synthetic",
                      "measured_seconds": measured}, "estimate": estimate}  # fmt: skip


def test_the_fit_recovers_the_coefficients_that_made_the_points() -> None:
    points = [
        _point("a", _program(1e-3, 10, 1e-6), "fit", "host"),
        _point("b", _program(5e-3, 4000, 2e-6), "fit"),
        _point("c", _program(2e-2, 100, 5e-6), "fit", "host"),
        _point("d", _program(3e-4, 20000, 1e-7), "fit"),
        _point("held out", _program(7e-3, 300, 3e-6), "validate"),
    ]
    found = calibration.calibrate_points(points, {"libtpu": "x"})
    for name, value in TRUE.items():
        assert found["coefficients"][name] == pytest.approx(value, rel=1e-6), name
    assert all(p["calibrated_ratio"] == pytest.approx(1.0) for p in found["points"])


def test_validation_points_do_not_move_the_fit() -> None:
    fitted = [_point(str(i), _program(10.0**-i, 50 * i, 1e-6), "fit", "host") for i in range(2, 6)]
    held = _point("held", _program(1e-3, 100, 1e-6), "validate")
    wrong = dict(held, point=dict(held["point"], measured_seconds=1.0))
    a = calibration.calibrate_points([*fitted, held], {})
    b = calibration.calibrate_points([*fitted, wrong], {})
    assert a["coefficients"] == b["coefficients"]
    assert b["bands"]["MXU-bound"]["held_out"] > 0.99  # the bad point shows in its band


def test_an_upper_bound_fits_nothing_and_keeps_its_kind_whatever_is_declared() -> None:
    fitted = [_point(str(i), _program(10.0**-i, 50 * i, 1e-6), "fit", "host") for i in range(2, 6)]
    bound = _point("bound", _program(1e-3, 100, 1e-6, undecided=0.5e-3), "fit")
    bound["point"] |= {"measured_seconds": 1e-4, "kind": calibration.ATTENTION}
    declared = _point("declared", _program(2e-3, 100, 1e-6), "validate")
    declared["point"]["kind"] = calibration.ATTENTION
    a = calibration.calibrate_points([*fitted, declared], {})
    b = calibration.calibrate_points([*fitted, bound, declared], {})
    assert a["coefficients"] == b["coefficients"]  # the upper bound moved nothing
    kinds = {p["name"]: p["kind"] for p in b["points"]}
    assert kinds["bound"] == "data-dependent" and kinds["declared"] == calibration.ATTENTION
    assert b["bands"][calibration.ATTENTION]["points"] == 1


def test_a_coefficient_no_point_informs_keeps_its_neutral_value() -> None:
    """With no point timed from the host, the host call costs nothing (not a guess)."""
    points = [_point(str(i), _program(10.0**-i, 10 * i, 1e-6), "fit") for i in range(2, 5)]
    coefficients = calibration.calibrate_points(points, {})["coefficients"]
    assert coefficients["host_call_seconds"] == 0.0


def test_kinds_follow_what_the_calibrated_time_is_made_of() -> None:
    kind = lambda e: calibration.kind(calibration.ProgramFeatures.of_estimate(e), TRUE)  # noqa: E731
    assert kind(_program(1e-3, 100)) == "MXU-bound"
    assert kind(_program(1e-3, 100_000)) == "grid-step-bound"  # 30 ms of steps
    assert kind(_program(1e-3, 100, memory=0.9e-3)) == "memory-bound"
    assert kind(_program(1e-3, 100, undecided=0.5e-3)) == "data-dependent"


def test_bands_are_the_largest_error_of_each_kind_and_none_without_a_point() -> None:
    table = [
        {"kind": "MXU-bound", "role": "fit", "calibrated_ratio": 1.02, "static_ratio": 0.9},
        {"kind": "MXU-bound", "role": "validate", "calibrated_ratio": 0.95, "static_ratio": 0.8},
    ]
    bands = calibration.bands(table)
    assert bands["MXU-bound"]["band"] == pytest.approx(0.05)
    assert bands["MXU-bound"]["held_out"] == pytest.approx(0.05)
    assert bands["MXU-bound"]["fit"] == pytest.approx(0.02)
    assert bands["MXU-bound"]["points"] == 2
    assert bands["memory-bound"]["band"] is None
    found = {"bands": bands}
    assert calibration.level_band(found, "MXU-bound") == pytest.approx(0.05)
    assert calibration.level_band(found, "memory-bound") == pytest.approx(0.05)  # widest known
    assert math.isnan(calibration.level_band(None))


def test_tokamax_grid_steps_count_the_tiles_each_group_touches() -> None:
    tiles = {"tile_m": 128, "tile_n": 256, "tile_k": 512}
    # groups of 128 (one tile), 0 (none), 200 (rows 128..328: tiles 1 and 2), 56 (tile 2 again)
    assert tokamax_timings.gmm_steps([128, 0, 200, 56], tiles, k=1024, n=512) == 2 * 4 * 2
    assert tokamax_timings.gmm_steps([384], tiles, k=512, n=256) == 3


def test_the_published_points_are_as_their_sources_print_them() -> None:
    points = {p.name: p for p in calibration_points.matmul_guide_points()}
    assert len(points) == 21
    assert points["XLA matmul 8192³"].measured_seconds == pytest.approx(6.047e-3, rel=1e-3)
    pallas = points["Pallas matmul 8192³, blocks 512/1024/1024"]
    assert pallas.measured_seconds == pytest.approx(6.099e-3, rel=1e-3)
    assert dict(pallas.program.kwargs) == {"bm": 512, "bk": 1024, "bn": 1024}
    assert {p.timing for p in points.values()} == {"host"}
    fitted = [p for p in calibration_points.all_points() if p.role == "fit"]
    assert 0 < len(fitted) < len(calibration_points.all_points()) / 2


COMMITTED = calibration.load("v5e")
GENERATIONS = ("v5e", "v5p", "v6e", "v7x")
"""The generations with a committed calibration."""


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_committed_calibration_is_of_this_analysis_and_these_points(generation: str) -> None:
    """A change of the analysis (or of a point) must come with a rerun of
    ``pallas-flash bench --calibrate``."""
    committed = calibration.load(generation)
    assert committed is not None and committed["generation"] == generation
    assert committed["analysis"] == whole_program.ANALYSIS_VERSION
    published = {p.name: p.measured_seconds for p in calibration_points.all_points(generation)}
    for point in committed["points"]:
        if point["name"] in published:  # tokamax's need tokamax (its version's data) installed
            assert point["measured_seconds"] == pytest.approx(published[point["name"]])
    if generation == "v5e":
        guide = {p.name for p in calibration_points.matmul_guide_points()}
        assert guide <= {p["name"] for p in committed["points"]}, "every guide point estimated"


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_docs_page_states_the_committed_calibration(generation: str) -> None:
    text = DOCS_PAGE.read_text()
    begin, end = readme.calibration_markers(generation)
    block = text[text.index(begin) : text.index(end) + len(end)] + "\n"
    assert block == readme.render_calibration_block(calibration.load(generation)), (
        f"docs/calibration.md: rerun `pallas-flash readme --calibration` on the committed "
        f"calibration-{generation}.json"
    )


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_section_lists_every_point_and_band(generation: str) -> None:
    committed = calibration.load(generation)
    text = "\n".join(calibration_report.section(committed))
    for point in committed["points"]:
        assert f"| {point['name']} |" in text
    for kind in calibration.KINDS:
        assert f"| {kind} |" in text


def test_v5e_takes_the_attention_band_of_v5p_which_has_the_same_mxus() -> None:
    v5p = calibration.load("v5p")["bands"][calibration.ATTENTION]
    borrowed = COMMITTED["bands"][calibration.ATTENTION]
    assert borrowed["generation"] == "v5p" and borrowed["band"] == v5p["band"] > 0
    assert "**v5p's** points" in "\n".join(calibration_report.section(COMMITTED))


def test_attention_points_are_fitted_and_their_band_held_out() -> None:
    """On v5p and v6e about half the timed attention points fit the model, the others are
    held out, and the estimates that are upper bounds (data-dependent) fit nothing."""
    for generation in ("v5p", "v6e"):
        points = calibration.load(generation)["points"]
        attention = [p for p in points if p["kind"] == calibration.ATTENTION]
        fitted = [p for p in attention if p["role"] == "fit"]
        assert len(attention) >= 40 and 0.3 < len(fitted) / len(attention) < 0.7
        band = calibration.load(generation)["bands"][calibration.ATTENTION]
        assert band["held_out"] is not None and band["held_out"] <= band["band"]


def test_v7x_is_validated_with_v6e_s_coefficients_and_fits_nothing() -> None:
    """No coefficient is fitted on v7x: its points are all held out, calibrated by the
    coefficients of v6e (the same two 256-wide MXUs), and their bands say how the model
    carries to a generation it never saw, forward and backward."""
    v7x = calibration.load("v7x")
    assert v7x["coefficients_from"] == "v6e"
    assert v7x["coefficients"] == calibration.load("v6e")["coefficients"]
    assert {p["role"] for p in v7x["points"]} == {"validate"}
    for kind in (calibration.ATTENTION, calibration.ATTENTION_BACKWARD):
        band = v7x["bands"][kind]
        assert band["points"] >= 30 and band["held_out"] == band["band"]
    assert calibration.describe(v7x).startswith("v6e's coefficients, validated on")
