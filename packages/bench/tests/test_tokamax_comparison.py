"""Ours beside tokamax at its measured shapes: our program on the same shapes in our layout,
and the committed comparisons the tokamax page states."""

from __future__ import annotations

import json
import pathlib

import pytest

from pallas_flash_bench.calibration import tokamax_comparison
from pallas_flash_bench.calibration.calibration_point import CalibrationPoint
from pallas_flash_bench.views import readme
from pallas_flash_estimate import calibration
from pallas_flash_estimate.aot.program_ref import ArraySpec, ProgramRef

ROOT = pathlib.Path(__file__).parents[3]
GENERATIONS = ("v5p", "v6e", "v7x")


def test_ours_runs_on_the_same_shapes_in_our_layout() -> None:
    q, kv = ArraySpec((4, 4096, 32, 128), "bfloat16"), ArraySpec((4, 4096, 8, 128), "bfloat16")
    kwargs = (("causal", True), ("config", json.dumps({"block_q": 1024})), ("residuals", False))
    theirs = ProgramRef("m:tokamax_flash_attention", (q, kv, kv), kwargs)
    point = CalibrationPoint("p", theirs, 1e-3, "s", "device", "fit")
    ours = tokamax_comparison.ours(point)
    assert ours.function.endswith(":pallas_attention")
    kv_ours = (4, 8, 4096, 128)
    assert [a.shape for a in ours.args] == [(4, 32, 4096, 128), kv_ours, kv_ours]
    assert dict(ours.kwargs) == {"causal": True}


def test_our_backward_runs_from_the_same_residuals_in_our_layout() -> None:
    """tokamax's VJP key (max logits, log-sum-exp ``[batch, heads, seq]``, out, dout, q, k,
    v in ``[batch, seq, heads, dim]``) as our backward's arguments: the log-sum-exp as
    ``[batch, heads, 1, seq]`` and the rest in our layout; the max logits unused."""
    res = ArraySpec((4, 32, 4096), "float32")
    q, kv = ArraySpec((4, 4096, 32, 192), "bfloat16"), ArraySpec((4, 4096, 8, 192), "bfloat16")
    out, v = ArraySpec((4, 4096, 32, 128), "bfloat16"), ArraySpec((4, 4096, 8, 128), "bfloat16")
    kwargs = (("causal", False), ("config", "{}"))
    theirs = ProgramRef("m:tokamax_flash_attention_vjp", (res, res, out, out, q, kv, v), kwargs)
    point = CalibrationPoint("p", theirs, 1e-3, "s", "device", "validate",
                             kind=calibration.ATTENTION_BACKWARD)  # fmt: skip
    ours = tokamax_comparison.ours(point)
    assert ours.function.endswith(":pallas_attention_backward")
    assert [a.shape for a in ours.args] == [
        (4, 32, 1, 4096), (4, 32, 4096, 128), (4, 32, 4096, 128), (4, 32, 4096, 192),
        (4, 8, 4096, 192), (4, 8, 4096, 128),
    ]  # fmt: skip
    assert dict(ours.kwargs) == {"causal": False}


@pytest.mark.parametrize(
    ("speedup", "theirs_bound", "ours_bound", "said"),
    [
        (1.5, False, False, "ahead"),
        (1.5, True, False, "unknown: tokamax's estimate is an upper bound"),
        (1.1, True, False, "level"),
        (0.5, False, True, "unknown: our estimate is an upper bound"),
        (0.5, True, False, "behind"),
    ],
)
def test_no_lead_rests_on_an_upper_bound(speedup, theirs_bound, ours_bound, said) -> None:
    theirs, ours = {"upper_bound": theirs_bound}, {"upper_bound": ours_bound}
    assert tokamax_comparison._verdict(speedup, 0.2, theirs, ours) == said


def _committed(generation: str) -> dict:
    path = ROOT / "docs" / "results" / f"against-tokamax-{generation}.json"
    return json.loads(path.read_text())


@pytest.mark.parametrize("generation", GENERATIONS)
def test_every_timed_shape_is_compared_under_the_attention_band(generation: str) -> None:
    found = _committed(generation)
    assert found["generation"] == generation and 0 < found["band"] < 1
    assert found["band"] == found["bands"]["forward"]
    assert len(found["shapes"]) >= 30
    for shape in found["shapes"]:
        assert shape["pass"] in found["bands"]
        theirs = shape["tokamax"]["calibrated_seconds"]
        ours = (shape["ours"] or {}).get("calibrated_seconds")
        if shape["speedup"] is not None:
            assert shape["speedup"] == pytest.approx(theirs / ours)
        else:
            assert shape["verdict"] == "unknown" and shape["error"]
        if shape["tokamax"]["upper_bound"]:
            assert not shape["verdict"].startswith("ahead"), "no lead over an upper bound"


def test_the_tokamax_page_states_the_committed_comparisons() -> None:
    text = (ROOT / "docs" / "tokamax.md").read_text()
    start = text.index(readme.TOKAMAX_BEGIN)
    end = text.index(readme.TOKAMAX_END) + len(readme.TOKAMAX_END)
    block = readme.render_tokamax_block([_committed(g) for g in GENERATIONS])
    assert text[start:end] + "\n" == block, (
        "docs/tokamax.md: rerun `pallas-flash readme --against-tokamax` on the committed files"
    )


def test_the_readme_counts_the_committed_comparisons() -> None:
    text = (ROOT / "README.md").read_text()
    start = text.index(readme.TOKAMAX_SUMMARY_BEGIN)
    end = text.index(readme.TOKAMAX_SUMMARY_END) + len(readme.TOKAMAX_SUMMARY_END)
    runs = [_committed(g) for g in GENERATIONS]
    assert text[start:end] + "\n" == readme.render_tokamax_summary(runs), (
        "README.md: rerun `pallas-flash readme --against-tokamax` on the committed files"
    )
    for found in runs:
        for row in tokamax_comparison.summary_rows(found):
            assert sum(map(int, row[3:7])) == int(row[2]), "every shape has one verdict"
