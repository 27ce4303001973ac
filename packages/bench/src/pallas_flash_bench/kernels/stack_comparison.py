"""One sweep on two stacks, from the two runs' rows (``results.json``'s ``rows``, pinned and
newest): each program's static latency on both and the newest over the pinned, the programs
compiled on one stack only, and the estimates a program has a figure under on one stack only.
The stacks page (`pallas_flash_bench.views.stacks_report`) formats what these return.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pallas_flash_bench.kernels.row_figures import SPREAD, figure_value

Row = Mapping[str, Any]


def program_key(row: Row) -> tuple[Any, ...]:
    """What names a program across runs: its workload's label, subject, configuration and kind."""
    return row.get("label"), row.get("subject"), row.get("config"), row.get("kind")


def on_both(pinned: Sequence[Row], newest: Sequence[Row]) -> list[tuple[Row, Row]]:
    """Each program run on both stacks, as (pinned row, newest row), in the newest run's order."""
    before = {program_key(r): r for r in pinned}
    return [(before[program_key(r)], r) for r in newest if program_key(r) in before]


def latency_ratios(pinned: Sequence[Row], newest: Sequence[Row]) -> list[dict[str, Any]]:
    """Every program with a static latency on both stacks: ``{"pinned": row, "newest": row,
    "ratio": newest latency / pinned latency}`` (above 1: slower on the newest stack)."""
    found = []
    for old, new in on_both(pinned, newest):
        before, after = figure_value(old, "latency_seconds"), figure_value(new, "latency_seconds")
        if before and after:
            found.append({"pinned": old, "newest": new, "ratio": after / before})
    return found


def only_on_one(pinned: Sequence[Row], newest: Sequence[Row]) -> dict[str, list[Row]]:
    """The compiled rows of each stack (``pinned``, ``newest``) whose program the other stack
    did not compile (a reference new on one, or a compile that failed)."""
    compiled = [{program_key(r): r for r in rows if r.get("compiled")} for rows in (pinned, newest)]
    before, after = compiled
    return {"pinned": [r for k, r in before.items() if k not in after],
            "newest": [r for k, r in after.items() if k not in before]}  # fmt: skip


def _unknown(row: Row) -> set[str]:
    """The estimates (`row_figures.SPREAD`) under which a row has no figure."""
    estimates = row.get("estimates") or {}
    return {name for name in SPREAD if not (estimates.get(name) or {}).get("cycles")}


def unknown_on_one(pinned: Sequence[Row], newest: Sequence[Row]) -> list[dict[str, Any]]:
    """The programs with a figure under an estimate on one stack and none on the other: where
    the estimator could not read one compiler's output. ``{"row": newest row, "stack": where
    it is unknown, "estimates": [names]}`` each."""
    found = []
    for old, new in on_both(pinned, newest):
        for stack, missing in (("newest", _unknown(new) - _unknown(old)),
                               ("pinned", _unknown(old) - _unknown(new))):  # fmt: skip
            if missing:
                found.append({"row": new, "stack": stack,
                              "estimates": [n for n in SPREAD if n in missing]})  # fmt: skip
    return found
