"""Tests of the roofline plot: a readable, non-blank PNG; points, ceilings and title."""

from __future__ import annotations

import copy
import json
import math
import pathlib
from typing import Any

import numpy as np
import pytest
from matplotlib.image import imread

from pallas_flash_bench.views.roofline import roofline_figure, roofline_points, write_roofline

SAMPLE = pathlib.Path(__file__).parent / "samples" / "results_small.json"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def results() -> dict[str, Any]:
    return json.loads(SAMPLE.read_text(encoding="utf-8"))


def _read_png(path: pathlib.Path) -> np.ndarray:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
    return image


def _distinct_colours(image: np.ndarray) -> int:
    return len(np.unique(image.reshape(-1, image.shape[-1]), axis=0))


def test_fixture_writes_a_non_blank_png(results: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = tmp_path / "plots" / "roofline.png"
    write_roofline(results, path)
    image = _read_png(path)
    assert _distinct_colours(image) > 10


def test_empty_rows_write_the_ceilings(results: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = tmp_path / "roofline.png"
    write_roofline({"meta": results["meta"], "rows": []}, path)
    assert _distinct_colours(_read_png(path)) > 1
    axes = roofline_figure({"meta": results["meta"], "rows": []}).axes[0]
    assert [line.get_label() for line in axes.get_lines()][:2] == [
        "HBM bandwidth 819 GB/s",
        "peak 197 TFLOP/s",
    ]
    assert not axes.collections  # no points


def test_rows_without_values_are_skipped(results: dict[str, Any], tmp_path: pathlib.Path) -> None:
    null_rows = [row for row in results["rows"] if not row["compiled"]]
    assert null_rows, "the fixture must hold a row with null figures"
    stripped = copy.deepcopy(results["rows"][0])
    del stripped["figures"]
    no_figures = copy.deepcopy(results["rows"][0])
    no_figures["figures"] = None
    rows = [*null_rows, stripped, no_figures]

    assert roofline_points({"meta": results["meta"], "rows": rows}) == []
    with_nulls, empty = tmp_path / "nulls.png", tmp_path / "empty.png"
    write_roofline({"meta": results["meta"], "rows": rows}, with_nulls)
    write_roofline({"meta": results["meta"], "rows": []}, empty)
    assert np.array_equal(_read_png(with_nulls), _read_png(empty))


@pytest.mark.parametrize("name", ["useful_flops", "hbm_bytes", "latency_seconds"])
@pytest.mark.parametrize("value", [None, 0.0, float("nan"), "n/a"])
def test_a_row_missing_one_value_is_skipped(
    results: dict[str, Any], name: str, value: object
) -> None:
    row = copy.deepcopy(results["rows"][0])
    row["figures"][name]["value"] = value
    partial = {"meta": results["meta"], "rows": [row, results["rows"][1]]}
    assert [p.subject for p in roofline_points(partial)] == ["pallas_flash"]
    assert len(roofline_figure(partial).axes[0].collections) == 1


def test_points_are_intensity_and_achieved_flops(results: dict[str, Any]) -> None:
    points = roofline_points(results)
    with_values = [r for r in results["rows"] if r["figures"]["latency_seconds"]["value"]]
    assert len(points) == len(with_values) == 5
    xla = next(p for p in points if p.subject == "xla" and p.op == "forward")
    assert math.isclose(xla.intensity, 2.2e11 / 5.0e7)
    assert math.isclose(xla.flops_per_second, 2.2e11 / 1.234e-3)
    assert xla.source == "model"


def test_one_marker_per_point_colour_per_subject_marker_per_op(results: dict[str, Any]) -> None:
    axes = roofline_figure(results).axes[0]
    assert axes.get_xscale() == axes.get_yscale() == "log"
    assert len(axes.collections) == 5
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert legend == [
        "HBM bandwidth 819 GB/s",
        "peak 197 TFLOP/s",
        "jax_splash",
        "pallas_flash",
        "xla",
        "forward",
        "forward_backward",
        "decode",
    ]
    ridge = [t.get_text() for t in axes.texts if t.get_text().startswith("ridge")]
    assert ridge == ["ridge 241 FLOP/B"]


def test_title_says_estimated_unless_measured(results: dict[str, Any]) -> None:
    title = roofline_figure(results).axes[0].get_title()
    assert "v5e-1" in title
    assert "estimated (static/model), not measured" in title

    for row in results["rows"]:
        latency = row["figures"].get("latency_seconds")
        if latency and latency["value"]:
            latency["source"] = "measured-tpu"
    title = roofline_figure(results).axes[0].get_title()
    assert "measured (measured-tpu)" in title
    assert "not measured" not in title


def test_roof_and_points_are_per_chip(results: dict[str, Any]) -> None:
    results["meta"]["target"].update(name="v5e-4", chips=4)
    (row,) = [r for r in results["rows"] if r["figures"].get("latency_seconds")][:1]
    key = (row["subject"], row["config"], row["label"])

    def achieved() -> dict[tuple[str, str, str], float]:
        points = roofline_points(results)
        return {(p.subject, p.config, p.label): p.flops_per_second for p in points}

    one_chip = achieved()[key]
    row["workload"]["chips"] = 4
    assert achieved()[key] == pytest.approx(one_chip / 4)
    axes = roofline_figure(results).axes[0]
    labels = [line.get_label() for line in axes.get_lines()]
    assert "peak 197 TFLOP/s" in labels
    assert "HBM bandwidth 819 GB/s" in labels
    assert "v5e-4, per chip" in axes.get_title()
