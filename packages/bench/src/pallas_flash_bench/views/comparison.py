"""How far the report trusts a lead: each row under every static estimate, and each backend
against the fastest of jax's own kernels on its workload (the records of
`pallas_flash_bench.kernels.against_references`, formatted).

``spread_table`` and ``against_references_table`` are sections of the report and of the
README's report block (`readme`); ``mfu_range`` is the MFU range column of the results tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pallas_flash_bench.kernels.against_references import LEVEL, by_workload
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
)

ESTIMATE_TITLES = {
    "schedule": "Schedule (bundles)",
    "mxu": "MXU floor (matmuls)",
    "critical_path": "Critical path",
    "push8": "Pushes at 8, no overlap",
    "push16": "Pushes at 16, no overlap",
    "dma": "DMA bound",
}
"""The program estimates of a row (``row_figures.SPREAD``), as the report names them."""


def estimate_figure(row: Mapping[str, Any], name: str, key: str) -> float | None:
    """A row's figure ``key`` (``cycles``, ``latency_seconds``, ``mfu``) under one estimate."""
    return finite_number(((row.get("estimates") or {}).get(name) or {}).get(key))


def mfu_range(row: Mapping[str, Any]) -> str:
    """A row's ``mfu_range`` (`row_figures.mfu_range`): ``66.7 to 97.6 %``; ``—`` without."""
    found = row.get("mfu_range")
    if not found:
        return MISSING
    return f"{100 * found['low']:.1f} to {percent(found['high'])}"


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


def _speedup(value: Any) -> str:
    value = finite_number(value)
    return MISSING if value is None else f"{value:.2f}x"


def _calibrated_speedup(record: Mapping[str, Any]) -> str:
    """The calibrated speed-up with the row's band; ``unknown`` where it has none."""
    value = finite_number(record.get("speedup_calibrated"))
    return "unknown" if value is None else f"{value:.2f}x ±{record['band']:.0%}"


def _compared(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows with a record against the references, in table order: by workload in the
    order of the run, then by subject."""
    compared = [r for r in rows if r.get("against_references")]
    return [row for group in by_workload(compared) for row in sorted(group, key=sort_key)]


def against_references_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each backend's row beside the fastest reference kernel of the same workload (its
    ``against_references`` record)."""
    table = []
    for row in _compared(rows):
        record = row["against_references"]
        fastest = record.get("fastest")
        if fastest is None or not figure(row, "latency_seconds")[0]:
            continue
        table.append([
            label(row), subject(row), tagged(row, "latency_seconds", ms),
            tagged(row, "mfu", percent), subject(fastest).removesuffix(" [reference]"),
            tagged(fastest, "latency_seconds", ms), tagged(fastest, "mfu", percent),
            _speedup(record.get("speedup")), _speedup(record.get("speedup_no_overlap")),
            _calibrated_speedup(record), _lead(record),
        ])  # fmt: skip
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


def _verdicts(record: Mapping[str, Any]) -> tuple[dict[str, list[str]], list[str]]:
    """Per verdict (ahead, level, behind, unknown), the estimates under which a row gets it
    (``Title 1.07x``; from its record's ``estimates``), and what the estimates it is behind
    under assume."""
    verdicts: dict[str, list[str]] = {"ahead": [], "level": [], "behind": [], "unknown": []}
    turns: list[str] = []
    for name, title in ESTIMATE_TITLES.items():
        found = (record.get("estimates") or {}).get(name) or {"verdict": "unknown"}
        if found["verdict"] == "unknown":
            verdicts["unknown"].append(title)
            continue
        verdicts[found["verdict"]].append(f"{title} {found['speedup']:.2f}x")
        if found["verdict"] == "behind" and ASSUMPTIONS[name] not in turns:
            turns.append(ASSUMPTIONS[name])
    return {verdict: items for verdict, items in verdicts.items() if items}, turns


def _lead(record: Mapping[str, Any]) -> str:
    """Whether a backend's row beats the fastest reference under every estimate, or which
    estimates its lead rests on (speed-ups under the others; `_verdicts`)."""
    found, turns = _verdicts(record)
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


def verdict_summary(record: Mapping[str, Any]) -> str:
    """`_lead` in a few words: ``level under every estimate``, ``ahead under 4 of 6, level
    under 2``."""
    found, _ = _verdicts(record)
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
    for row in _compared(rows):
        record = row["against_references"]
        calibrated = figure(row, "calibrated_latency_seconds")[0]
        if not calibrated or not any(estimate_figure(row, n, "cycles") for n in ESTIMATE_TITLES):
            continue
        fastest = record.get("fastest_calibrated")
        found.append(Headline(
            label(row), subject(row), f"{ms(calibrated)} ±{record['band']:.0%}",
            MISSING if fastest is None else subject(fastest).removesuffix(" [reference]"),
            MISSING if fastest is None else ms(figure(fastest, "calibrated_latency_seconds")[0]),
            _calibrated_speedup(record), verdict_summary(record),
        ))  # fmt: skip
    return found


def headline_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The README's table: `headlines` as Markdown."""
    table = [list(entry) for entry in headlines(rows)]
    return [*markdown_table(HEADLINE_HEADER, table), ""] if table else []
