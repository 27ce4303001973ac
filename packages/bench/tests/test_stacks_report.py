"""The stacks page: the same sweep on two stacks, verdicts and programs side by side."""

from __future__ import annotations

import copy
import json
import pathlib
from typing import Any

import pytest

from pallas_flash_bench.kernels import against_references
from pallas_flash_bench.views import stacks_report

MAIN_RUN = pathlib.Path(__file__).parents[3] / "docs" / "results" / "quick-v5e-4.json"
if not MAIN_RUN.exists():
    pytest.skip("not run from the repository: no committed run", allow_module_level=True)


def _rows() -> list[dict[str, Any]]:
    return [r for r in json.loads(MAIN_RUN.read_text())["rows"] if r.get("compiled")]


def _slower(row: dict[str, Any], factor: float) -> dict[str, Any]:
    """``row`` with every latency (each estimate's, the headline and the calibrated one)
    ``factor`` times as long."""
    row = copy.deepcopy(row)
    row.pop("against_references", None)
    for estimate in row["estimates"].values():
        if estimate.get("latency_seconds"):
            estimate["latency_seconds"] *= factor
    for name in ("latency_seconds", "calibrated_latency_seconds"):
        row["figures"][name]["value"] *= factor
    return row


def _table(lines: list[str]) -> list[list[str]]:
    """A Markdown table's header and rows (its rule left out)."""
    rows = [[c.strip() for c in x.strip("|").split("|")] for x in lines if x.startswith("|")]
    return [rows[0], *rows[2:]]


def _is_pallas_forward_4096_causal(row: dict[str, Any]) -> bool:
    return row["subject"] == "pallas" and row["label"] == "forward N=4096 causal"


def test_a_verdict_that_moves_between_the_stacks_is_marked() -> None:
    pinned = _rows()
    newest = [_slower(r, 3.0) if _is_pallas_forward_4096_causal(r) else r for r in pinned]
    for rows in (pinned, newest):  # as the runner does when it makes a run's rows
        against_references.annotate(rows)
    header, *rows = _table(stacks_report.verdicts_table(pinned, newest))
    assert header == list(stacks_report.VERDICTS_HEADER)
    moved = {(r[0], r[1]): r[-1] for r in rows}
    assert moved[("forward N=4096 causal", "pallas")] == "ahead -> behind"
    assert moved[("forward N=1024", "pallas")] == "no"
    (row,) = [r for r in rows if r[:2] == ["forward N=4096 causal", "pallas"]]
    assert row[4].startswith("ahead") and row[7].startswith("behind under every estimate")


def test_each_program_has_its_latency_on_both_stacks() -> None:
    pinned = _rows()
    newest = [_slower(r, 1.5) if _is_pallas_forward_4096_causal(r) else r for r in pinned]
    _, *rows = _table(stacks_report.programs_table(pinned, newest))
    ratios = {(r[0], r[1]): r[-1] for r in rows}
    assert ratios[("forward N=4096 causal", "pallas")] == "1.500"
    assert ratios[("forward N=1024", "pallas")] == "1.000"
    assert len(rows) == len([r for r in pinned if r["figures"]["latency_seconds"]["value"]])


def test_a_program_compiled_on_one_stack_only_is_named() -> None:
    pinned = _rows()
    newest = [r for r in pinned if not _is_pallas_forward_4096_causal(r)]
    assert stacks_report.only_on_one(pinned, newest) == [
        "- only on the pinned stack: forward N=4096 causal, pallas",
        "",
    ]
    assert stacks_report.only_on_one(pinned, pinned) == []


def test_an_estimate_unknown_on_one_stack_is_named() -> None:
    pinned = _rows()
    newest = copy.deepcopy(pinned)
    (row,) = [r for r in newest if _is_pallas_forward_4096_causal(r)]
    row["estimates"]["critical_path"] = {"cycles": None, "latency_seconds": None, "mfu": None}
    assert stacks_report.unknown_on_one(pinned, newest) == [
        "- unknown on the newest stack only: forward N=4096 causal, pallas under Critical path",
        "",
    ]
    assert stacks_report.unknown_on_one(pinned, pinned) == []
