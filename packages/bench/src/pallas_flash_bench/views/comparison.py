"""How far the report trusts a lead: each row under every static estimate, and each backend
against the fastest of jax's own kernels on its workload.

``spread_table`` and ``against_references_table`` are sections of the report and of the
README's report block (`readme`); ``mfu_range`` is the MFU range column of the results tables.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pallas_flash_bench.views.cells import (
    MISSING,
    figure,
    finite_number,
    label,
    markdown_table,
    ms,
    op_then_sort_key,
    percent,
    sort_key,
    subject,
    tagged,
    workload_of,
)

ESTIMATE_TITLES = {
    "schedule": "Schedule (bundles)",
    "mxu": "MXU floor (matmuls)",
    "critical_path": "Critical path",
    "push8": "Pushes at 8, no overlap",
    "push16": "Pushes at 16, no overlap",
    "dma": "DMA bound",
}
"""The program estimates of a row (``runner.SPREAD``), as the report names them."""


def estimate_figure(row: Mapping[str, Any], name: str, key: str) -> float | None:
    """A row's figure ``key`` (``cycles``, ``latency_seconds``, ``mfu``) under one estimate."""
    return finite_number(((row.get("estimates") or {}).get(name) or {}).get(key))


RANGE_ESTIMATES = ("critical_path", "push8", "push16", "dma")
"""The estimates that are whole figures like the headline: the schedule alone and the MXU
floor alone are its two parts (each a bound on time only), left out of the MFU range."""


def mfu_range(row: Mapping[str, Any]) -> str:
    """Least and most MFU over the headline and the whole estimates (`RANGE_ESTIMATES`):
    ``66.7 to 97.6 %``; ``—`` without them."""
    if not any(estimate_figure(row, name, "mfu") is not None for name in RANGE_ESTIMATES):
        return MISSING
    values = [
        figure(row, "mfu")[0],
        *(estimate_figure(row, name, "mfu") for name in RANGE_ESTIMATES),
    ]
    known = [v for v in values if v is not None]
    if not known:
        return MISSING
    return f"{100 * min(known):.1f} to {percent(max(known))}"


SPREAD_HEADER = ("Workload", "Subject", "MFU (headline)", *ESTIMATE_TITLES.values())
"""Columns of `spread_table`."""


def spread_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each row's MFU under every estimate beside the headline figure."""
    with_spread = sorted((r for r in rows if r.get("estimates")), key=op_then_sort_key)
    if not with_spread:
        return []
    header = SPREAD_HEADER
    table = [
        [
            label(row),
            subject(row),
            tagged(row, "mfu", percent),
            *(percent(estimate_figure(row, name, "mfu")) for name in ESTIMATE_TITLES),
        ]
        for row in with_spread
    ]
    intro = (
        "The same compiled program under each static estimate (MFU; latency is compute or "
        "memory time, whichever is longer, as for the headline). Headline: the schedule's "
        "executed bundles or the busiest MXU's matmul cycles, whichever is more, weight pushes "
        "free. Schedule: executed bundles only, one per cycle. MXU floor: the busiest MXU's "
        "`vmatmul`s only (16 cycles per bf16 vreg). Critical path: the compiler's latency model "
        "per executed basic block, a bf16 weight push 8 cycles, overlapped with the previous "
        "tile's matmuls. Pushes at 8 / 16, no overlap: every `vmatpush` charged 8 / 16 cycles on "
        "its MXU on top of the matmuls (or the bundles, if more): how much a lead rests on "
        "pushes being hidden. DMA bound: per kernel the longer of its compute and its block "
        "copies at the HBM bandwidth (copies whose predicate the schedule cannot decide "
        "counted every step). No hardware measurement tells which is right."
    )
    return ["## How sure the estimates are", "", intro, "", *markdown_table(header, table), ""]


AGAINST_REFERENCES_HEADER = (
    "Workload",
    "Backend",
    "Est. latency",
    "MFU",
    "Fastest jax kernel",
    "Its latency",
    "Its MFU",
    "Speed-up",
    "Speed-up, no overlap",
    "Speed-up, calibrated",
    "Lead under every estimate?",
)
"""Columns of `against_references_table`."""


def row_band(row: Mapping[str, Any]) -> float:
    """The relative error within which a row's lead is level: the calibrated band of its
    kind of program (`runner.calibrated_latency`), or `LEVEL` where it has none."""
    calibrated = (row.get("figures") or {}).get("calibrated_latency_seconds") or {}
    band = finite_number(calibrated.get("band"))
    return LEVEL if band is None else max(band, LEVEL)


def _calibrated(row: Mapping[str, Any]) -> float | None:
    return figure(row, "calibrated_latency_seconds")[0]


def _calibrated_speedup(row: Mapping[str, Any], references: Sequence[Mapping[str, Any]]) -> str:
    """The fastest reference's calibrated latency over the row's, with the row's band;
    ``unknown`` where the row or a reference has none."""
    mine = _calibrated(row)
    theirs = [_calibrated(r) for r in references]
    if mine is None or None in theirs:
        return "unknown"
    return f"{min(theirs) / mine:.2f}x ±{row_band(row):.0%}"


def against_references_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each backend's row beside the fastest reference kernel of the same workload."""
    table = []
    for group in _by_workload(rows):
        references = [r for r in group if r.get("kind") == "reference"]
        timed = [r for r in references if figure(r, "latency_seconds")[0] is not None]
        if not timed:
            continue
        fastest = min(timed, key=lambda r: figure(r, "latency_seconds")[0])
        fastest_latency = figure(fastest, "latency_seconds")[0]
        serial = [figure(r, "latency_no_overlap_seconds")[0] for r in timed]
        fastest_serial = min((t for t in serial if t is not None), default=None)
        ours = [r for r in group if r.get("kind") != "reference"]
        for row in sorted((r for r in ours if figure(r, "latency_seconds")[0]), key=sort_key):
            latency = figure(row, "latency_seconds")[0]
            row_serial = figure(row, "latency_no_overlap_seconds")[0]
            table.append(
                [
                    label(row),
                    subject(row),
                    tagged(row, "latency_seconds", ms),
                    tagged(row, "mfu", percent),
                    subject(fastest).removesuffix(" [reference]"),
                    tagged(fastest, "latency_seconds", ms),
                    tagged(fastest, "mfu", percent),
                    f"{fastest_latency / latency:.2f}x" if latency else MISSING,
                    f"{fastest_serial / row_serial:.2f}x"
                    if fastest_serial and row_serial
                    else MISSING,
                    _calibrated_speedup(row, references),
                    _lead(row, references),
                ]
            )
    if not table:
        return []
    header = AGAINST_REFERENCES_HEADER
    intro = (
        "Each backend against the fastest of jax's own kernels on the same workload, through "
        "the same analysis (speed-up: the jax kernel's estimated latency over the backend's). "
        "The estimate takes a kernel's HBM transfers and its compute to overlap fully; the "
        "no-overlap column takes them not to overlap at all (latency: compute + memory time, "
        "against the jax kernel with the least of it). The calibrated column holds both "
        "through the calibration (see *Calibration against published measurements*): "
        "their static time plus what the published v5e measurements say a static estimate "
        "misses, with the band of the backend's kind of program. The last column redoes the "
        "speed-up under each estimate of the section above, against the jax kernel fastest "
        "under that estimate: whether the lead (or the deficit) holds under all of them, or "
        "under which it turns. A speed-up within the calibrated band of 1x is *level* (no "
        f"estimate is known to be closer than that; {LEVEL:.1%} where a row has no "
        "calibration), and where any reference has no figure under an estimate the verdict "
        "under it is *unknown*, never a comparison with the others alone."
    )
    return ["## Against jax's kernels", "", intro, "", *markdown_table(header, table), ""]


ASSUMPTIONS = {
    "push8": "weight pushes hidden under the matmuls",
    "push16": "weight pushes hidden under the matmuls",
    "dma": "block copies hidden under the compute",
    "critical_path": "the schedule, not the compiler's latency model",
    "schedule": "the MXU floor, not the bundles",
    "mxu": "the bundles, not the MXU floor",
}
"""What a lead that turns under an estimate rests on."""


LEVEL = 0.005
"""The least band of a tie: a speed-up within it of 1 is level even where a row has no
calibrated band (`row_band`)."""


def _verdicts(
    row: Mapping[str, Any], references: Sequence[Mapping[str, Any]]
) -> tuple[dict[str, list[str]], list[str]]:
    """Per verdict (ahead, level, behind, unknown), the estimates under which a backend's row
    gets it against the fastest reference (``Title 1.07x``), and what the estimates it is
    behind under assume; within the row's band of 1 (`row_band`) is level, and an estimate
    under which the row or any reference has no figure is unknown."""
    band = row_band(row)
    verdicts: dict[str, list[str]] = {"ahead": [], "level": [], "behind": [], "unknown": []}
    turns: list[str] = []
    for name, title in ESTIMATE_TITLES.items():
        mine = estimate_figure(row, name, "latency_seconds")
        theirs = [estimate_figure(r, name, "latency_seconds") for r in references]
        if not mine or not all(theirs):
            verdicts["unknown"].append(title)
            continue
        speedup = min(theirs) / mine
        verdict = "ahead" if speedup >= 1 + band else "level" if speedup > 1 - band else "behind"
        verdicts[verdict].append(f"{title} {speedup:.2f}x")
        if verdict == "behind" and ASSUMPTIONS[name] not in turns:
            turns.append(ASSUMPTIONS[name])
    return {verdict: items for verdict, items in verdicts.items() if items}, turns


def _lead(row: Mapping[str, Any], references: Sequence[Mapping[str, Any]]) -> str:
    """Whether a backend's row beats the fastest reference under every estimate, or which
    estimates its lead rests on (speed-ups under the others; `_verdicts`)."""
    found, turns = _verdicts(row, references)
    if not found:
        return MISSING
    if len(found) == 1:
        ((verdict, items),) = found.items()
        return f"{verdict} under every estimate ({', '.join(items)})"
    parts = "; ".join(f"{verdict} under {', '.join(items)}" for verdict, items in found.items())
    if "behind" not in found:
        return f"never behind: {parts}"
    if "ahead" not in found:
        return f"never ahead: {parts}"
    return f"the lead rests on {' and '.join(turns)}: {parts}"


def verdict_summary(row: Mapping[str, Any], references: Sequence[Mapping[str, Any]]) -> str:
    """`_lead` in a few words: ``level under every estimate``, ``ahead under 4 of 6, level
    under 2``."""
    found, _ = _verdicts(row, references)
    if not found:
        return MISSING
    if len(found) == 1:
        return f"{next(iter(found))} under every estimate"
    total = sum(len(items) for items in found.values())
    counts = [f"{verdict} under {len(items)}" for verdict, items in found.items()]
    return f"{counts[0]} of {total}, " + ", ".join(counts[1:])


HEADLINE_HEADER = ("Workload", "Backend", "Latency, calibrated", "Fastest jax kernel",
                   "Its latency, calibrated", "Speed-up, calibrated", "Verdict")  # fmt: skip
"""Columns of `headline_table`, one per field of `Headline`."""


class Headline(NamedTuple):
    """One backend's row against the jax kernel fastest on its workload, calibrated: the
    cells of a `headline_table` line, with ``key`` naming the workload and backend (the same
    on every run of the same sweep)."""

    workload: str
    backend: str
    latency: str
    fastest: str
    fastest_latency: str
    speedup: str
    verdict: str

    @property
    def key(self) -> tuple[str, str]:
        return self.workload, self.backend


def headlines(rows: Sequence[Mapping[str, Any]]) -> list[Headline]:
    """Each backend with kernels (a static estimate: not the XLA baseline) beside the jax
    kernel fastest on the same workload, both calibrated, and the verdict over every
    estimate (`verdict_summary`)."""
    found = []
    for group in _by_workload(rows):
        references = [r for r in group if r.get("kind") == "reference"]
        known = [r for r in references if _calibrated(r) is not None]
        ours = [
            r for r in group
            if r.get("kind") != "reference" and _calibrated(r)
            and any(estimate_figure(r, name, "cycles") for name in ESTIMATE_TITLES)
        ]  # fmt: skip
        if not references or not ours:
            continue
        fastest = min(known, key=_calibrated) if known else None
        for row in sorted(ours, key=sort_key):
            found.append(Headline(
                label(row), subject(row),
                f"{ms(_calibrated(row))} ±{row_band(row):.0%}",
                MISSING if fastest is None else subject(fastest).removesuffix(" [reference]"),
                MISSING if fastest is None else ms(_calibrated(fastest)),
                _calibrated_speedup(row, references),
                verdict_summary(row, references),
            ))  # fmt: skip
    return found


def headline_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The README's table: `headlines` as Markdown."""
    table = [list(entry) for entry in headlines(rows)]
    return [*markdown_table(HEADLINE_HEADER, table), ""] if table else []


def _by_workload(rows: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(json.dumps(workload_of(row), sort_keys=True), []).append(row)
    return list(groups.values())
