"""The ranking of tokamax's configurations by the estimate: the pick's rank and band verdict,
its page section, and the committed rankings the calibration page states."""

from __future__ import annotations

import pathlib

import pytest

from pallas_flash_bench.calibration import config_ranking
from pallas_flash_bench.views import readme

ROOT = pathlib.Path(__file__).parents[3]
RANKED = ("v5p", "v6e")


def _config(bq: int, bkv: int, bkvc: int, scheduler: bool = True) -> dict:
    return {"block_q": bq, "block_kv": bkv, "block_kv_compute": bkvc, "q_layout": 1,
            "k_layout": 2, "v_layout": 1, "use_experimental_scheduler": scheduler}  # fmt: skip


def _shape(pick: dict) -> config_ranking.RankedShape:
    return config_ranking.RankedShape("key", {"q": "bf16[4,4096,16,128]"}, pick, 1.5e-3, ())


def _row(config: dict, seconds: float, pick: dict) -> dict:
    return {"config": config, "static_seconds": seconds * 0.9, "calibrated_seconds": seconds,
            "pick": config == pick}  # fmt: skip


@pytest.mark.parametrize(
    ("pick_seconds", "rank", "within"),
    [(1.0e-3, 1, True), (1.1e-3, 2, True), (1.3e-3, 2, False)],
)
def test_the_pick_is_ranked_and_held_to_the_band_of_the_first(
    pick_seconds: float, rank: int, within: bool
) -> None:
    pick = _config(1024, 1024, 512)
    first = _config(2048, 2048, 512)
    rows = sorted([_row(first, 1.05e-3, pick), _row(pick, pick_seconds, pick),
                   _row(_config(1024, 1024, 256), 2e-3, pick)],
                  key=lambda r: r["calibrated_seconds"])  # fmt: skip
    verdict = config_ranking._verdict(_shape(pick), rows, band=0.2)
    assert verdict["pick_rank"] == rank
    assert verdict["within_band"] is within
    assert verdict["measured_pick"] == {"config": pick, "seconds": 1.5e-3}


def test_a_pick_that_gave_no_estimate_has_no_rank() -> None:
    pick = _config(1024, 1024, 512)
    rows = [_row(_config(2048, 2048, 512), 1e-3, pick)]
    verdict = config_ranking._verdict(_shape(pick), rows, band=0.2)
    assert verdict["pick_rank"] is None and verdict["within_band"] is False


@pytest.mark.parametrize("generation", RANKED)
def test_the_committed_ranking_covers_three_shapes(generation: str) -> None:
    found = config_ranking.committed(generation, ROOT / "docs" / "results")
    assert found is not None and found["generation"] == generation
    assert [s["q"] for s in found["shapes"]] == list(config_ranking.RANKED_SHAPES)
    for shape in found["shapes"]:
        assert sum(r["pick"] for r in shape["configs"]) == 1, "the pick was estimated"
        times = [r["calibrated_seconds"] for r in shape["configs"]]
        assert times == sorted(times)


def test_the_calibration_page_states_the_committed_rankings() -> None:
    rankings = [config_ranking.committed(g, ROOT / "docs" / "results") for g in RANKED]
    text = (ROOT / "docs" / "calibration.md").read_text()
    start = text.index(readme.RANKING_BEGIN)
    end = text.index(readme.RANKING_END) + len(readme.RANKING_END)
    assert text[start:end] + "\n" == readme.render_ranking_block(rankings), (
        "docs/calibration.md: rerun `pallas-flash readme --ranking` on the committed rankings"
    )
