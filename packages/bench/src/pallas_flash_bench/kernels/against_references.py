"""Each backend's row against the fastest of jax's own kernels on its workload: the speed-ups
the report and the README show, computed once when a run's rows are made (`annotate`) and
kept in ``results.json``, so that the views only format them.

A row's record, ``row["against_references"]``:

- ``band``: the relative error within which its lead is level (`row_band`);
- ``fastest``: the reference with the least headline latency (`reference_summary`), and
  ``speedup``, its latency over the row's;
- ``speedup_no_overlap``: the least no-overlap latency of the references over the row's;
- ``fastest_calibrated``: the reference with the least calibrated latency, and
  ``speedup_calibrated``, its latency over the row's (None where the row or any reference
  has no calibrated figure);
- ``estimates``: per static estimate (`row_figures.SPREAD`), the fastest
  reference's latency under it over the row's, and the verdict: ``ahead`` (a speed-up of at
  least ``1 + band``), ``level`` (within the band of 1), ``behind``, or ``unknown`` where the
  row or any reference has no figure under it (never a comparison with the others alone).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pallas_flash_bench.kernels.row_figures import SPREAD, figure_value

LEVEL = 0.005
"""The least band of a tie: a speed-up within it of 1 is level even where a row has no
calibrated band (`row_band`)."""

Row = TypeVar("Row", bound=Mapping[str, Any])

SUMMARY_FIGURES = ("latency_seconds", "mfu", "calibrated_latency_seconds")
"""The figures of a reference a record keeps (`reference_summary`)."""


def _estimate_latency(row: Mapping[str, Any], name: str) -> float | None:
    value = ((row.get("estimates") or {}).get(name) or {}).get("latency_seconds")
    return float(value) if isinstance(value, int | float) else None


def row_band(row: Mapping[str, Any]) -> float:
    """The relative error within which a row's lead is level: the calibrated band of its
    kind of program (`runner.calibrated_latency`), or `LEVEL` where it has none."""
    calibrated = (row.get("figures") or {}).get("calibrated_latency_seconds") or {}
    band = calibrated.get("band")
    return LEVEL if not isinstance(band, int | float) else max(float(band), LEVEL)


def verdict(speedup: float | None, band: float) -> str:
    """``ahead``, ``level`` or ``behind`` for a speed-up under a band; ``unknown`` for None."""
    if speedup is None:
        return "unknown"
    return "ahead" if speedup >= 1 + band else "level" if speedup > 1 - band else "behind"


def reference_summary(row: Mapping[str, Any]) -> dict[str, Any]:
    """What a record keeps of a reference: its name, configuration and `SUMMARY_FIGURES`."""
    figures = row.get("figures") or {}
    return {"subject": row.get("subject"), "config": row.get("config"), "kind": row.get("kind"),
            "figures": {k: figures[k] for k in SUMMARY_FIGURES if k in figures}}  # fmt: skip


def _ratio(theirs: float | None, mine: float | None) -> float | None:
    return theirs / mine if theirs is not None and mine else None


def compare(row: Mapping[str, Any], references: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``row``'s record against ``references`` (the module docstring)."""
    band = row_band(row)
    timed = [r for r in references if figure_value(r, "latency_seconds") is not None]
    fastest = min(timed, key=lambda r: figure_value(r, "latency_seconds")) if timed else None
    serial = [t for r in timed if (t := figure_value(r, "latency_no_overlap_seconds")) is not None]
    known = [r for r in references if figure_value(r, "calibrated_latency_seconds") is not None]
    fastest_calibrated = (min(known, key=lambda r: figure_value(r, "calibrated_latency_seconds"))
                          if known else None)  # fmt: skip
    estimates = {}
    for name in SPREAD:
        theirs = [_estimate_latency(r, name) for r in references]
        every = bool(references) and all(theirs)
        speedup = _ratio(min(theirs), _estimate_latency(row, name)) if every else None
        estimates[name] = {"speedup": speedup, "verdict": verdict(speedup, band)}
    return {
        "band": band,
        "fastest": None if fastest is None else reference_summary(fastest),
        "speedup": None if fastest is None
        else _ratio(figure_value(fastest, "latency_seconds"), figure_value(row, "latency_seconds")),
        "speedup_no_overlap": _ratio(min(serial, default=None),
                                     figure_value(row, "latency_no_overlap_seconds")),
        "fastest_calibrated": None if fastest_calibrated is None
        else reference_summary(fastest_calibrated),
        "speedup_calibrated": None if len(known) < len(references) else _ratio(
            figure_value(fastest_calibrated, "calibrated_latency_seconds"),
            figure_value(row, "calibrated_latency_seconds")),
        "estimates": estimates,
    }  # fmt: skip


def by_workload(rows: Sequence[Row]) -> list[list[Row]]:
    """``rows`` grouped by workload, the groups in the order their first row comes."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(json.dumps(row.get("workload") or {}, sort_keys=True), []).append(row)
    return list(groups.values())


def annotate(rows: Sequence[dict[str, Any]]) -> None:
    """Sets ``against_references`` on every compiled non-reference row whose workload has a
    reference (and removes it from the others)."""
    for row in rows:
        row.pop("against_references", None)
    for group in by_workload(rows):
        references = [r for r in group if r.get("kind") == "reference"]
        if not references:
            continue
        for row in group:
            if row.get("kind") != "reference" and row.get("compiled"):
                row["against_references"] = compare(row, references)
