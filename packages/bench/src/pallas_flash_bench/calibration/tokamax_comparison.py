"""``pallas-flash bench --against-tokamax``: our ``pallas`` forward beside tokamax's measured
kernel, at every shape tokamax timed on a generation.

For each of tokamax's timed flash attention keys of the target's generation that the bench
reads (`tokamax_timings.flash_attention_points`, without residuals), two programs are
compiled for the generation and estimated the same way: tokamax's kernel at the
configuration it picked, and ``pf.attention(..., backend="pallas")`` on the same shapes in
our layout (``[batch, heads, seq, head_dim]``; the transposition is not charged), causal as
the key. Both are calibrated by the generation's calibration (attention band); ours is held
against tokamax's **estimate** (the speed-up and its verdict under the band), with tokamax's
**measured** time beside it as the check on that estimate.

Layout of ``comparison.json``: ``{"generation", "band", "versions", "shapes": [{"q", "k",
"causal", "tokamax": {"config", "measured_seconds", "static_seconds", "calibrated_seconds",
"upper_bound"}, "ours": {"static_seconds", "calibrated_seconds", "upper_bound"} or None,
"error", "speedup", "verdict"}]}``: a verdict is ``ahead``, ``level``, ``behind`` or ``unknown``
(with its reason after a colon).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any

from pallas_flash_bench.calibration import calibration_programs, calibration_run, tokamax_timings
from pallas_flash_bench.calibration.calibration_point import CalibrationPoint
from pallas_flash_bench.kernels.against_references import verdict
from pallas_flash_bench.runs.cache import ResultCache
from pallas_flash_bench.runs.workers import run_cached
from pallas_flash_bench.views.cells import markdown_table, ms
from pallas_flash_estimate import calibration
from pallas_flash_estimate.aot.program_ref import ArraySpec, ProgramRef
from pallas_flash_estimate.targets import Target


def ours(point: CalibrationPoint) -> ProgramRef:
    """Our ``pallas`` forward on ``point``'s shapes: tokamax's ``[batch, seq, heads, dim]``
    as ours, ``[batch, heads, seq, dim]``."""
    args = tuple(ArraySpec((a.shape[0], a.shape[2], a.shape[1], a.shape[3]), a.dtype)
                 for a in point.program.args)  # fmt: skip
    causal = dict(point.program.kwargs)["causal"]
    return ProgramRef(f"{calibration_programs.__name__}:pallas_attention", args,
                      (("causal", causal),))  # fmt: skip


def _verdict(speedup: float | None, band: float, theirs: Mapping, ours: Mapping | None) -> str:
    """`verdict` of the speed-up, but a lead over an estimate that is an upper bound (its
    kernel branches on data the schedule cannot see: tokamax's causal kernels at one or two
    blocks a row), or a deficit against ours when ours is one, is not known."""
    found = verdict(speedup, band)
    if found == "ahead" and theirs.get("upper_bound"):
        return "unknown: tokamax's estimate is an upper bound"
    if found == "behind" and (ours or {}).get("upper_bound"):
        return "unknown: our estimate is an upper bound"
    return found


def compare(target: Target, versions: dict, cache: ResultCache, workers: int,
            out_dir: pathlib.Path) -> dict:  # fmt: skip
    """Ours against tokamax at each of its timed shapes of ``target``'s generation;
    ``comparison.json`` and ``comparison.md`` written to ``out_dir``."""
    generation = target.generation
    points = [p for p in tokamax_timings.flash_attention_points(generation)
              if not dict(p.program.kwargs)["residuals"]]  # fmt: skip
    refs = [ref for p in points for ref in (p.program, ours(p))]
    jobs = [dict(calibration_run.program_job(ref, target), id=i) for i, ref in enumerate(refs)]
    results = run_cached(jobs, versions, cache, workers, "ours and tokamax")
    band = calibration.level_band(calibration.load(generation), calibration.ATTENTION)
    shapes = []
    for i, point in enumerate(points):
        theirs, mine = (calibration_run.attention_figures(results.get(j), generation)
                        for j in (2 * i, 2 * i + 1))  # fmt: skip
        kwargs = dict(point.program.kwargs)
        error = None if mine else calibration_run.error_of(results.get(2 * i + 1)) or "no estimate"
        speedup = None
        if theirs and mine and theirs["calibrated_seconds"] and mine["calibrated_seconds"]:
            speedup = theirs["calibrated_seconds"] / mine["calibrated_seconds"]
        q, k = (f"bf16[{','.join(map(str, a.shape))}]" for a in point.program.args[:2])
        shapes.append({
            "q": q, "k": k, "causal": kwargs["causal"],
            "tokamax": {"config": json.loads(kwargs["config"]),
                        "measured_seconds": point.measured_seconds, **(theirs or {})},
            "ours": mine, "error": error, "speedup": speedup,
            "verdict": _verdict(speedup, band, theirs or {}, mine),
        })  # fmt: skip
    found = {"generation": generation, "band": band, "versions": dict(versions),
             "shapes": shapes}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "comparison.json").write_text(json.dumps(found, indent=1) + "\n")
    (out_dir / "comparison.md").write_text("\n".join(section(found)) + "\n")
    return found


def _time(figures: Mapping[str, Any] | None, name: str) -> str:
    value = (figures or {}).get(name)
    return "—" if value is None else ms(value)


def section(found: Mapping[str, Any], heading: str = "###") -> list[str]:
    """A generation's comparison as Markdown: one row per shape, and the verdicts' count."""
    counts = {v: sum(s["verdict"].startswith(v) for s in found["shapes"])
              for v in ("ahead", "level", "behind", "unknown")}  # fmt: skip
    summary = ", ".join(f"{v} on {n}" for v, n in counts.items() if n)
    versions = found["versions"]
    lines = [f"{heading} {found['generation']}: ours beside tokamax at its measured shapes", "",
             f"Both compiled for {found['generation']} and estimated the same way (jax "
             f"{versions.get('jax')}, libtpu {versions.get('libtpu')}), calibrated with the "
             f"generation's attention band (±{found['band'] * 100:.1f} %): speed-up is "
             "tokamax's calibrated time over ours; tokamax's measured time is the check on its "
             f"estimate. Ours is {summary}.", ""]  # fmt: skip
    rows = []
    for s in found["shapes"]:
        tokamax = s["tokamax"]
        speedup = "—" if s["speedup"] is None else f"{s['speedup']:.2f}x"
        said = s["verdict"] if s["error"] is None else f"{s['verdict']}: {s['error']}"
        rows.append([s["q"], s["k"], "causal" if s["causal"] else "full",
                     ms(tokamax["measured_seconds"]), _time(tokamax, "calibrated_seconds"),
                     _time(s["ours"], "calibrated_seconds"), speedup, said])  # fmt: skip
    header = ("q (tokamax's layout)", "k", "mask", "tokamax measured", "tokamax calibrated",
              "ours calibrated", "speed-up", "verdict")  # fmt: skip
    return [*lines, *markdown_table(header, rows), ""]
