"""Roofline plot of a benchmark run: ``roofline.png`` from the results dict of ``results.json``.

x is arithmetic intensity (useful flops / HBM bytes), y the achieved FLOP/s per chip (useful
flops / latency / the chips the call runs on); the roof is one chip's
``min(peak_flops, hbm_bandwidth * x)``. Drawn with matplotlib's object API
on an Agg canvas, so it touches no global pyplot state and needs no display.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from pallas_flash_bench.views.cells import finite_number

OP_MARKERS = {"forward": "o", "forward_backward": "s", "decode": "^", "ragged": "v"}
OTHER_OP_MARKER = "D"
OP_ORDER = ("forward", "forward_backward", "decode", "ragged")
ESTIMATED_DEFAULT = "static/model"
SOURCE_ORDER = ("static", "model", "compiler", "measured-cpu", "measured-tpu")


@dataclass(frozen=True)
class RooflinePoint:
    """One row placed on the roofline."""

    subject: str
    config: str
    op: str
    label: str
    intensity: float  # FLOP / byte
    flops_per_second: float  # achieved FLOP/s per chip
    source: str | None  # source tag of the latency the point uses


def _positive_number(value: Any) -> float | None:
    """``value`` as a float when it is a finite positive number, else None."""
    number = finite_number(value)
    return number if number is not None and number > 0 else None


def _positive(figures: Mapping[str, Any], name: str) -> tuple[float | None, str | None]:
    """``(value, source)`` of a figure when its value is a finite positive number."""
    figure = figures.get(name)
    if not isinstance(figure, Mapping):
        return None, None
    value = _positive_number(figure.get("value"))
    return (value, figure.get("source")) if value is not None else (None, None)


def roofline_points(results: Mapping[str, Any]) -> list[RooflinePoint]:
    """The rows that have useful flops, HBM bytes and a latency, as roofline points."""
    points = []
    for row in results.get("rows") or []:
        figures = row.get("figures") or {}
        flops, _ = _positive(figures, "useful_flops")
        hbm_bytes, _ = _positive(figures, "hbm_bytes")
        latency, source = _positive(figures, "latency_seconds")
        if flops is None or hbm_bytes is None or latency is None:
            continue
        workload = row.get("workload") or {}
        chips = _positive_number(workload.get("chips")) or 1
        points.append(
            RooflinePoint(
                subject=str(row.get("subject") or "?"),
                config=str(row.get("config") or ""),
                op=str(workload.get("op") or "?"),
                label=str(row.get("label") or ""),
                intensity=flops / hbm_bytes,
                flops_per_second=flops / latency / chips,
                source=source,
            )
        )
    return points


def _sources_text(points: Sequence[RooflinePoint]) -> str:
    """Second title line: whether the points are measured or estimated, and from what."""
    sources = sorted(
        {p.source for p in points if p.source},
        key=lambda s: (SOURCE_ORDER.index(s) if s in SOURCE_ORDER else len(SOURCE_ORDER), s),
    )
    measured = [s for s in sources if s.startswith("measured")]
    if points and sources and len(measured) == len(sources):
        return f"measured ({'/'.join(sources)})"
    if measured:
        return f"mixed sources ({'/'.join(sources)}): estimates and measurements"
    estimated = "/".join(sources) if sources else ESTIMATED_DEFAULT
    return f"estimated ({estimated}), not measured"


def _x_range(points: Sequence[RooflinePoint], ridge: float | None) -> tuple[float, float]:
    """Intensity range covering every point and two decades either side of the ridge."""
    xs = [p.intensity for p in points]
    if ridge:
        xs += [ridge / 100, ridge * 100]
    if not xs:
        return 0.1, 1e4
    return min(xs) / 2, max(xs) * 2


def roofline_figure(results: Mapping[str, Any]) -> Figure:
    """The roofline ``Figure`` (on an Agg canvas) of a results dict."""
    target = (results.get("meta") or {}).get("target") or {}
    peak = _positive_number(target.get("peak_flops"))  # one chip's: points are per chip
    bandwidth = _positive_number(target.get("hbm_bandwidth"))
    ridge = peak / bandwidth if peak and bandwidth else None
    points = roofline_points(results)

    figure = Figure(figsize=(9, 6), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.set_xscale("log")
    axes.set_yscale("log")

    x_low, x_high = _x_range(points, ridge)
    # The roof: the bandwidth diagonal up to the ridge, then the compute ceiling.
    x_knee = ridge if ridge and x_low < ridge < x_high else None
    roof_handles = []
    if bandwidth:
        x_end = x_knee if x_knee else x_high if not peak else x_low
        if x_end > x_low:
            roof_handles += axes.plot(
                [x_low, x_end],
                [bandwidth * x_low, bandwidth * x_end],
                color="tab:gray",
                linewidth=1.5,
                label=f"HBM bandwidth {bandwidth / 1e9:.0f} GB/s",
            )
    if peak:
        x_start = x_knee if x_knee else x_low if not bandwidth else x_high
        if x_start < x_high:
            roof_handles += axes.plot(
                [x_start, x_high],
                [peak, peak],
                color="black",
                linewidth=1.5,
                label=f"peak {peak / 1e12:.0f} TFLOP/s",
            )
    if x_knee and peak:
        axes.plot([x_knee], [peak], marker="x", color="black", markersize=8, zorder=4)
        axes.annotate(
            f"ridge {x_knee:.0f} FLOP/B",
            xy=(x_knee, peak),
            xytext=(-10, 8),  # above and left of the ridge, clear of the kernels' points
            textcoords="offset points",
            horizontalalignment="right",
            fontsize=9,
        )
    axes.set_xlim(x_low, x_high)
    ys = [p.flops_per_second for p in points]
    if peak:
        ys.append(peak)
    if bandwidth:
        ys.append(bandwidth * x_low)
    if ys:
        axes.set_ylim(min(ys) / 2, max(ys) * 3)

    subjects = sorted({p.subject for p in points})
    ops = [op for op in OP_ORDER if any(p.op == op for p in points)]
    ops += sorted({p.op for p in points} - set(OP_ORDER))
    colors = {s: f"C{i % 10}" for i, s in enumerate(subjects)}
    for point in points:
        axes.scatter(
            [point.intensity],
            [point.flops_per_second],
            color=colors[point.subject],
            marker=OP_MARKERS.get(point.op, OTHER_OP_MARKER),
            s=45,
            edgecolors="black",
            linewidths=0.5,
            zorder=3,
        )

    subject_handles = [
        Line2D([], [], linestyle="", marker="o", color=colors[s], label=s) for s in subjects
    ]
    op_handles = [
        Line2D(
            [],
            [],
            linestyle="",
            marker=OP_MARKERS.get(op, OTHER_OP_MARKER),
            color="tab:gray",
            label=op,
        )
        for op in ops
    ]
    handles = roof_handles + subject_handles + op_handles
    if handles:
        axes.legend(handles=handles, fontsize=8, loc="lower right")

    name = (target.get("name") or "unknown target") + ", per chip"
    axes.set_title(f"Roofline: {name}\n{_sources_text(points)}", fontsize=11)
    axes.set_xlabel("arithmetic intensity (useful FLOP / HBM byte)")
    axes.set_ylabel("achieved FLOP/s per chip (useful FLOP / latency / chips)")
    axes.grid(True, which="both", linewidth=0.3, alpha=0.5)
    if not points:
        axes.text(
            0.02,
            0.97,
            "no row has flops, bytes and latency",
            transform=axes.transAxes,
            fontsize=9,
            va="top",
        )
    return figure


def write_roofline(results: Mapping[str, Any], path: pathlib.Path) -> None:
    """Write the roofline plot of ``results`` as a PNG to ``path``, creating its folder."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    roofline_figure(results).savefig(path, format="png")
