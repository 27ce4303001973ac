"""``pallas-flash bench --against-tokamax``: our ``pallas`` kernels beside tokamax's measured
ones, at every shape tokamax timed on a generation, forward and (where timed) backward.

For each of tokamax's timed flash attention keys of the target's generation that the bench
reads (`tokamax_timings.flash_attention_points` without residuals, and
`tokamax_timings.flash_attention_vjp_points`), two programs are compiled for the generation
and estimated the same way: tokamax's kernel at the configuration it picked, and ours on the
same shapes in our layout (``[batch, heads, seq, head_dim]``; the transposition is not
charged), causal as the key: ``pf.attention(..., backend="pallas")`` for a forward key, our
backward kernels from the same residuals for a backward key. Both are calibrated by the
generation's calibration (the band of the pass: attention forward or backward); ours is held
against tokamax's **estimate** (the speed-up and its verdict under the band), with tokamax's
**measured** time beside it as the check on that estimate.

Layout of ``comparison.json``: ``{"generation", "band", "bands", "versions", "shapes":
[{"pass", "q", "k", "causal", "tokamax": {"config", "measured_seconds", "static_seconds",
"calibrated_seconds", "upper_bound"}, "ours": {"static_seconds", "calibrated_seconds",
"upper_bound"} or None, "error", "speedup", "verdict"}]}``: ``band`` is the forward's,
``bands`` each pass's; a verdict is ``ahead``, ``level``, ``behind`` or ``unknown`` (with its
reason after a colon).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
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

PASSES = {calibration.ATTENTION: "forward", calibration.ATTENTION_BACKWARD: "backward"}
"""The pass of a point's kind."""

VERDICTS = ("ahead", "level", "behind", "unknown")


def _ours_layout(a: ArraySpec) -> ArraySpec:
    """tokamax's ``[batch, seq, heads, dim]`` as ours, ``[batch, heads, seq, dim]``."""
    return ArraySpec((a.shape[0], a.shape[2], a.shape[1], a.shape[3]), a.dtype)


def ours(point: CalibrationPoint) -> ProgramRef:
    """Our program on ``point``'s shapes in our layout: the ``pallas`` forward for a forward
    key; for a backward key our backward from the same residuals (tokamax's log-sum-exp
    ``[batch, heads, seq]`` as ours, ``[batch, heads, 1, seq]``; its max logits unused)."""
    causal = dict(point.program.kwargs)["causal"]
    module = calibration_programs.__name__
    if point.kind == calibration.ATTENTION_BACKWARD:
        _, lse, *arrays = point.program.args
        lse = ArraySpec((lse.shape[0], lse.shape[1], 1, lse.shape[2]), lse.dtype)
        args = (lse, *(_ours_layout(a) for a in arrays))
        return ProgramRef(f"{module}:pallas_attention_backward", args, (("causal", causal),))
    args = tuple(_ours_layout(a) for a in point.program.args)
    return ProgramRef(f"{module}:pallas_attention", args, (("causal", causal),))


def points(generation: str) -> list[CalibrationPoint]:
    """tokamax's timed forward keys without residuals and its timed backward keys."""
    forward = [p for p in tokamax_timings.flash_attention_points(generation)
               if not dict(p.program.kwargs)["residuals"]]  # fmt: skip
    return [*forward, *tokamax_timings.flash_attention_vjp_points(generation)]


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
    compared = points(generation)
    refs = [ref for p in compared for ref in (p.program, ours(p))]
    jobs = [dict(calibration_run.program_job(ref, target), id=i) for i, ref in enumerate(refs)]
    results = run_cached(jobs, versions, cache, workers, "ours and tokamax")
    found_calibration = calibration.load(generation)
    bands = {PASSES[kind]: calibration.level_band(found_calibration, kind) for kind in PASSES}
    shapes = []
    for i, point in enumerate(compared):
        theirs, mine = (calibration_run.attention_figures(results.get(j), generation, point.kind)
                        for j in (2 * i, 2 * i + 1))  # fmt: skip
        kwargs = dict(point.program.kwargs)
        error = None if mine else calibration_run.error_of(results.get(2 * i + 1)) or "no estimate"
        speedup = None
        if theirs and mine and theirs["calibrated_seconds"] and mine["calibrated_seconds"]:
            speedup = theirs["calibrated_seconds"] / mine["calibrated_seconds"]
        q_at = 4 if point.kind == calibration.ATTENTION_BACKWARD else 0
        q, k = (f"bf16[{','.join(map(str, a.shape))}]" for a in point.program.args[q_at : q_at + 2])
        band = bands[PASSES[point.kind]]
        shapes.append({
            "pass": PASSES[point.kind], "q": q, "k": k, "causal": kwargs["causal"],
            "tokamax": {"config": json.loads(kwargs["config"]),
                        "measured_seconds": point.measured_seconds, **(theirs or {})},
            "ours": mine, "error": error, "speedup": speedup,
            "verdict": _verdict(speedup, band, theirs or {}, mine),
        })  # fmt: skip
    found = {"generation": generation, "band": bands["forward"], "bands": bands,
             "versions": dict(versions), "shapes": shapes}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "comparison.json").write_text(json.dumps(found, indent=1) + "\n")
    (out_dir / "comparison.md").write_text("\n".join(section(found)) + "\n")
    return found


def _time(figures: Mapping[str, Any] | None, name: str) -> str:
    value = (figures or {}).get(name)
    return "—" if value is None else ms(value)


def section(found: Mapping[str, Any], heading: str = "###") -> list[str]:
    """A generation's comparison as Markdown: one row per shape, and the verdicts' count."""
    counts = {v: sum(s["verdict"].startswith(v) for s in found["shapes"]) for v in VERDICTS}
    summary = ", ".join(f"{v} on {n}" for v, n in counts.items() if n)
    versions = found["versions"]
    passes = sorted({s["pass"] for s in found["shapes"]}, key=list(PASSES.values()).index)
    bands = " and ".join(f"{p}'s ±{found['bands'][p] * 100:.1f} %" for p in passes)
    lines = [f"{heading} {found['generation']}: ours beside tokamax at its measured shapes", "",
             f"Both compiled for {found['generation']} and estimated the same way (jax "
             f"{versions.get('jax')}, libtpu {versions.get('libtpu')}), calibrated with the "
             f"generation's attention band ({bands}): speed-up is tokamax's calibrated time "
             "over ours; tokamax's measured time is the check on its estimate. Ours is "
             f"{summary}.", ""]  # fmt: skip
    rows = []
    for s in found["shapes"]:
        tokamax = s["tokamax"]
        speedup = "—" if s["speedup"] is None else f"{s['speedup']:.2f}x"
        said = s["verdict"] if s["error"] is None else f"{s['verdict']}: {s['error']}"
        rows.append([s["pass"], s["q"], s["k"], "causal" if s["causal"] else "full",
                     ms(tokamax["measured_seconds"]), _time(tokamax, "calibrated_seconds"),
                     _time(s["ours"], "calibrated_seconds"), speedup, said])  # fmt: skip
    header = ("pass", "q (tokamax's layout)", "k", "mask", "tokamax measured",
              "tokamax calibrated", "ours calibrated", "speed-up", "verdict")  # fmt: skip
    return [*lines, *markdown_table(header, rows), ""]


def summary_rows(found: Mapping[str, Any]) -> list[list[str]]:
    """One row per pass of a generation's comparison: its shapes, how many ours is ahead,
    level, behind or unknown on, and the range of the known speed-ups."""
    rows = []
    for name in dict.fromkeys(s["pass"] for s in found["shapes"]):
        shapes = [s for s in found["shapes"] if s["pass"] == name]
        counts = [sum(s["verdict"].startswith(v) for s in shapes) for v in VERDICTS]
        speedups = [s["speedup"] for s in shapes if s["speedup"] is not None]
        span = f"{min(speedups):.2f}x to {max(speedups):.2f}x" if speedups else "—"
        band = f"±{found['bands'][name] * 100:.1f} %"
        rows.append([found["generation"], name, str(len(shapes)), *map(str, counts), span, band])
    return rows


def summary(comparisons: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every generation's comparison in one table (the README's)."""
    header = ("generation", "pass", "shapes", *VERDICTS, "speed-up, calibrated", "band")
    return markdown_table(header, [row for found in comparisons for row in summary_rows(found)])
