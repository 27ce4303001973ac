"""A backend's record against the references: the fastest, the speed-ups, and where the
verdict under an estimate is unknown rather than a comparison with some references alone."""

from __future__ import annotations

import pytest

from pallas_flash_bench.kernels import against_references, chip_scaling
from pallas_flash_bench.kernels.row_figures import SPREAD


def _row(subject: str, kind: str, latency: float, calibrated: float | None = None,
         band: float = 0.08) -> dict:  # fmt: skip
    figures = {"latency_seconds": {"value": latency, "source": "static"}}
    if calibrated is not None:
        figures["calibrated_latency_seconds"] = {"value": calibrated, "source": "calibrated",
                                                 "band": band, "kind": "MXU-bound"}  # fmt: skip
    estimates = {name: {"latency_seconds": latency} for name in SPREAD}
    return {"subject": subject, "kind": kind, "config": "", "compiled": True,
            "workload": {"op": "forward", "seq_len": 4096}, "figures": figures,
            "estimates": estimates}  # fmt: skip


def test_the_fastest_reference_and_the_speedups() -> None:
    mine = _row("pallas", "backend", 1.0, calibrated=1.1)
    rows = [mine, _row("splash", "reference", 1.5, 1.6), _row("flash", "reference", 2.0, 1.5)]
    against_references.annotate(rows)
    record = mine["against_references"]
    assert record["fastest"]["subject"] == "splash" and record["speedup"] == pytest.approx(1.5)
    assert record["fastest_calibrated"]["subject"] == "flash"
    assert record["speedup_calibrated"] == pytest.approx(1.5 / 1.1)
    assert record["band"] == 0.08
    assert {e["verdict"] for e in record["estimates"].values()} == {"ahead"}
    assert "against_references" not in rows[1], "references get no record"


def test_a_reference_without_a_figure_makes_it_unknown() -> None:
    mine = _row("pallas", "backend", 1.0, calibrated=1.0)
    other = _row("flash", "reference", 0.5)  # no calibrated figure, and none under mxu
    other["estimates"]["mxu"]["latency_seconds"] = None
    rows = [mine, _row("splash", "reference", 1.004, 1.004), other]
    against_references.annotate(rows)
    record = mine["against_references"]
    assert record["speedup_calibrated"] is None
    assert record["estimates"]["mxu"] == {"speedup": None, "verdict": "unknown"}
    assert record["estimates"]["schedule"]["verdict"] == "behind"


def test_a_lead_within_the_band_is_level() -> None:
    assert against_references.verdict(1.07, 0.08) == "level"
    assert against_references.verdict(1.08, 0.08) == "ahead"
    assert against_references.verdict(0.9, 0.08) == "behind"
    assert against_references.row_band(_row("pallas", "backend", 1.0)) == against_references.LEVEL


def test_a_decode_row_on_four_chips_against_one_chip_and_the_hbm_time() -> None:
    workload = {"op": "decode", "seq_len": 131072, "q_heads": 32, "kv_heads": 8}
    one, four = ({"subject": "splitkv", "kind": "backend", "config": "",
                  "workload": {**workload, "chips": chips},
                  "figures": {"latency_seconds": {"value": latency, "source": "model"}}}
                 for chips, latency in ((1, 0.0008), (4, 0.0002)))  # fmt: skip
    chip_scaling.annotate([one, four], 819e9)
    assert four["chip_scaling"]["speedup_over_one_chip"] == pytest.approx(4.0)
    assert one["chip_scaling"]["speedup_over_one_chip"] is None
    hbm = one["chip_scaling"]["hbm_time_seconds"]
    assert four["chip_scaling"]["hbm_time_seconds"] == pytest.approx(hbm / 4)
    assert one["chip_scaling"]["latency_over_hbm_time"] == pytest.approx(0.0008 / hbm)
