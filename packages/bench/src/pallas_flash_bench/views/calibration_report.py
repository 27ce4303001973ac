"""The calibration as Markdown: the model's coefficients, each kind's error band, and every
point's measured, static and calibrated time (`calibration.calibrate_points`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pallas_flash_bench.views.cells import markdown_table, ms, num, percent
from pallas_flash_estimate.calibration import describe

KIND_MEANINGS = {
    "MXU-bound": "compute-bound programs with large blocks (matmuls; an attention row takes the "
    "attention band)",
    "memory-bound": "programs whose ops wait on HBM (decoding)",
    "grid-step-bound": "kernels whose grid steps' own cost dominates (small blocks)",
    "data-dependent": "kernels whose branches on data the schedule cannot see are all charged "
    "(an upper bound)",
    "attention forward": "flash attention forward kernels, causal or not, with or without "
    "residuals (tokamax's timed keys)",
    "attention backward": "flash attention backward kernels from the forward's residuals, causal "
    "or not (tokamax's timed VJP keys)",
    "train step": "a whole training step over a slice (collectives by the ICI model)",
    "serving run": "a serving run over a slice: its prefill, insert and decode programs",
}


def _time(seconds: float) -> str:
    """Milliseconds, or seconds from one second up (a whole train step)."""
    return f"{num(seconds)} s" if seconds >= 1 else ms(seconds)


def _band(value: float | None) -> str:
    return "no point" if value is None else f"±{percent(value)}"


def _ratio(low: float | None, high: float | None) -> str:
    return "—" if low is None else f"{low:.3f} to {high:.3f}"


def _bands_table(found: Mapping[str, Any], by_role: bool = False) -> list[str]:
    """Each kind's band, and its held-out points' (with ``by_role`` its fitted points' too); a
    kind whose band another generation's points give (`calibration.load`: v5e's attention,
    from v5p's) says so."""
    bands = []
    for name, b in found["bands"].items():
        meaning = KIND_MEANINGS[name]
        if "generation" in b:
            meaning += f" (**{b['generation']}'s** points and band: same MXUs)"
        fit = [_band(b["fit"])] if by_role else []
        bands.append([name, meaning, b["points"], _band(b["band"]), *fit, _band(b["held_out"]),
                      _ratio(b["static_ratio_min"], b["static_ratio_max"])])  # fmt: skip
    fit = ["Band, fit points"] if by_role else []
    return markdown_table(("Kind", "What it is", "Points", "Band", *fit, "Band, held-out points",
                           "Static / measured"), bands)  # fmt: skip


def summary_section(found: Mapping[str, Any] | None) -> list[str]:
    """The report's short section: each kind's band, from the committed calibration."""
    if found is None:
        return ["## Calibration", "", "No calibration for this target's generation: no band "
                "is known, so no lead is called beyond 0.5 %.", ""]  # fmt: skip
    versions = found["versions"]
    intro = (
        f"Calibrated figures (tagged `calibrated`) are the static estimate made a device "
        f"time by the committed calibration ({describe(found)}, analysis "
        f"{found['analysis']}; jax {versions.get('jax')}): each carries the band of its kind "
        "of program, and a lead within it is level. Every point and its source: "
        "`pallas-flash bench --calibrate`, or the docs' calibration page."
    )
    return ["## Calibration", "", intro, "", *_bands_table(found), ""]


def section(found: Mapping[str, Any], heading: str = "##") -> list[str]:
    """The calibration section: coefficients, bands per kind, the points."""
    c = found["coefficients"]
    versions = found["versions"]
    donor = found.get("coefficients_from")
    how = (f"taken from {donor}'s calibration, none fitted on {found['generation']} (every "
           "point is held out: the table shows how the model carries to a generation it "
           "never saw)" if donor else "fitted (non-negative least squares on the relative "
           "error) on the points marked *fit* and only held against the others")  # fmt: skip
    intro = (
        f"The static estimate held against every published TPU {found['generation']} "
        f"measurement whose program this installation compiles (jax {versions.get('jax')}, "
        f"libtpu {versions.get('libtpu')}, analysis {found['analysis']}). The calibration "
        f"charges what the schedule misses, {how}: "
        f"device time = {c['static_factor']:.4f} x static + {c['step_seconds'] * 1e6:.3f} µs "
        f"per Pallas grid step + {c['fill_factor']:.3f} x the first block's copies; a program "
        f"timed from the host adds {c['host_call_seconds'] * 1e6:.1f} µs per call. A kind's "
        "band is the largest error of the calibrated time over its points: a lead smaller "
        "than the band of its kind is level."
    )
    points = [
        [p["name"], p["role"], p["timing"], p["kind"], _time(p["measured_seconds"]),
         _time(p["static_seconds"]), f"{p['static_ratio']:.3f}",
         _time(p["calibrated_seconds"]), f"{p['calibrated_ratio']:.3f}"]
        for p in found["points"]
    ]  # fmt: skip
    sources = sorted({p["source"] for p in found["points"]})
    lines = [f"{heading} {found['generation']}: against published measurements", "", intro, ""]
    lines += _bands_table(found, by_role=True)
    lines += ["", *markdown_table(("Program", "Role", "Timed", "Kind", "Measured", "Static",
                                   "Static / measured", "Calibrated", "Calibrated / measured"),
                                  points)]  # fmt: skip
    lines += ["", "Sources:", "", *(f"- {s}" for s in sources)]
    if found["failed"]:
        lines += ["", "Points that gave no estimate:", ""]
        lines += [f"- {p['name']}: {p['error']}" for p in found["failed"]]
    return [*lines, ""]
