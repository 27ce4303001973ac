"""The estimator held against published v5e measurements: a small model of what the static
estimate misses, fitted on some points and validated on the others, and the error band it
leaves per kind of program.

A static estimate is the schedule's floor: it misses the cost of each Pallas grid step on
the scalar core and the DMA engines (issuing, waiting on semaphores, a step too short to
hide its copies), the first block's copy that nothing before it hides, the MXU's own stalls,
and, for a program timed from the host, the dispatch and synchronisation around the call.
The model charges them as

    measured = static_factor x static seconds + step_seconds x grid steps
               + fill_factor x first-block copy seconds (+ host_call_seconds if timed
               from the host)

with non-negative coefficients, fitted by least squares on the relative error over the
points whose ``role`` is ``fit`` (the bench's `pallas_flash_bench.calibration.calibration_points`)
and whose estimate is a floor (not ``data-dependent``: an upper bound would pull the fit down).
Every point is then classified by what its calibrated time is made of (`kind`), and a kind's
band is the largest relative error of the calibrated time over its points (fitted and
held-out alike): a lead smaller than the band is level, and every absolute figure carries it.

The fitted calibration is committed (``data/calibration-<generation>.json``, written by
``pallas-flash bench --calibrate``); `calibrate` applies it to any estimate.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
from collections.abc import Mapping, Sequence

import numpy as np

COEFFICIENTS = ("static_factor", "step_seconds", "fill_factor", "host_call_seconds")
"""The model's coefficients, in the order of `ProgramFeatures.values`."""

ATTENTION = "attention forward"
"""The kind of attention kernels, timed forward (tokamax's autotuning data)."""

ATTENTION_BACKWARD = "attention backward"
"""The kind of attention backward kernels (tokamax's VJP, timed on v7x only)."""

KINDS = ("MXU-bound", "memory-bound", "grid-step-bound", "data-dependent", ATTENTION,
         ATTENTION_BACKWARD, "train step", "serving run")  # fmt: skip
"""Kinds of program a band is given for: read from a program's estimate (`kind`), or declared
by its caller (an attention kernel, a train step, a serving run)."""

UNDECIDED_SHARE = 0.1
"""A program whose kernels spend more than this share of its static time in regions the
schedule cannot decide (branches on data, charged as if every step took them) is of kind
``data-dependent``: its estimate is an upper bound, not a calibrated figure."""


@dataclasses.dataclass(frozen=True)
class CalibratedTime:
    """A static estimate made a device time by the calibration: ``seconds``, give or take
    ``band`` (relative; None: no point of its ``kind`` was measured), ``calibration`` names
    the fit (points, libtpu)."""

    seconds: float
    band: float | None
    kind: str
    calibration: str


@dataclasses.dataclass(frozen=True)
class ProgramFeatures:
    """What the calibration reads of a program's static estimate (seconds on one chip)."""

    static_seconds: float
    grid_steps: float  # its Pallas kernels' grid steps
    fill_seconds: float  # each kernel run's first block of copies at the HBM bandwidth
    memory_bound_seconds: float = 0.0  # its ops whose HBM bytes outlast their schedule
    undecided_seconds: float = 0.0  # kernel regions charged though data decides them

    @classmethod
    def of_estimate(cls, estimate: Mapping[str, float]) -> ProgramFeatures:
        """The features of a whole-program estimate (`whole_program.program_estimate`)."""
        return cls(estimate["step_seconds_scheduled"], estimate["kernel_grid_steps"],
                   estimate["kernel_fill_seconds"], estimate["memory_bound_seconds"],
                   estimate.get("kernel_undecided_seconds", 0.0))  # fmt: skip

    @classmethod
    def run_estimate(cls, parts: Sequence[tuple[Mapping[str, float], float]]) -> dict[str, float]:
        """A run of several programs as one estimate of what `of_estimate` reads: each
        figure summed over ``parts``, (whole-program estimate, how often the run calls it)."""
        keys = ("step_seconds_scheduled", "kernel_grid_steps", "kernel_fill_seconds",
                "memory_bound_seconds", "kernel_undecided_seconds")  # fmt: skip
        return {key: sum(runs * e.get(key, 0.0) for e, runs in parts) for key in keys}

    @property
    def upper_bound(self) -> bool:
        """Whether the static estimate is an upper bound, not a floor: more than
        `UNDECIDED_SHARE` of it in regions charged though data decides them. The fit skips
        such a point (``data-dependent``, `kind`)."""
        return self.undecided_seconds > UNDECIDED_SHARE * self.static_seconds

    def values(self, host_call: bool = False) -> list[float]:
        """In the order of `COEFFICIENTS`; ``host_call``: the program was timed from the host."""
        return [self.static_seconds, self.grid_steps, self.fill_seconds, float(host_call)]


def kind(program: ProgramFeatures, coefficients: Mapping[str, float]) -> str:
    """What a program's calibrated device time is mostly made of: kernel regions taken on
    data the schedule cannot see (``data-dependent``, `UNDECIDED_SHARE`), its grid steps'
    cost (``grid-step-bound``: small blocks), ops waiting on HBM (``memory-bound``) or
    compute (``MXU-bound``, the rest)."""
    if program.upper_bound:
        return "data-dependent"
    steps = coefficients["step_seconds"] * program.grid_steps
    if steps >= device_seconds(program, coefficients) / 2:
        return "grid-step-bound"
    if program.memory_bound_seconds >= program.static_seconds / 2:
        return "memory-bound"
    return "MXU-bound"


def declared_kind(
    program: ProgramFeatures, coefficients: Mapping[str, float], declared: str | None
) -> str:
    """The kind a program's band is taken from: ``declared`` by its caller (``attention
    forward``, ``train step``), else read from its estimate (`kind`); a ``data-dependent``
    estimate stays so whatever is declared, as it is an upper bound, not a calibrated time."""
    read = kind(program, coefficients)
    return read if declared is None or read == "data-dependent" else declared


def device_seconds(program: ProgramFeatures, coefficients: Mapping[str, float]) -> float:
    """The calibrated device time of a program (no host call around it)."""
    return predicted_seconds(program.values(), coefficients)


def fit(rows: Sequence[tuple[list[float], float]]) -> dict[str, float]:
    """Non-negative least squares on the relative error: ``rows`` of
    (`ProgramFeatures.values`, measured seconds). A coefficient whose feature no row has
    stays at its neutral value (1 for a factor, 0 for a cost)."""
    from scipy.optimize import nnls

    a = np.array([f for f, _ in rows], dtype=float)
    measured = np.array([m for _, m in rows], dtype=float)
    used = a.any(axis=0)
    neutral = np.array([1.0, 0.0, 1.0, 0.0])
    rest = measured - a[:, ~used] @ neutral[~used]
    solution, _ = nnls(a[:, used] / measured[:, None], rest / measured)
    values = neutral.copy()
    values[used] = solution
    return dict(zip(COEFFICIENTS, (float(v) for v in values), strict=True))


def predicted_seconds(values: list[float], coefficients: Mapping[str, float]) -> float:
    """The calibrated time of `ProgramFeatures.values` (the host call's cost included when
    they say the program was timed from the host)."""
    return sum(coefficients[c] * v for c, v in zip(COEFFICIENTS, values, strict=True))


def calibrate_points(
    points: Sequence[Mapping],
    versions: Mapping[str, str | None],
    coefficients: Mapping[str, float] | None = None,
) -> dict:
    """The calibration of analysed ``points`` (``{"point": CalibrationPoint.to_json(),
    "estimate": whole-program estimate or None, "error": ...}``): coefficients fitted on
    the ``fit`` points (or the ``coefficients`` given: a generation only validated,
    `COEFFICIENTS_FROM`), each point's static and calibrated ratio to its measurement, and
    each kind's band. Points without an estimate are listed with their error."""
    estimated = [p for p in points if p.get("estimate")]
    programs = [ProgramFeatures.of_estimate(p["estimate"]) for p in estimated]
    rows = [(f.values(p["point"]["timing"] == "host"), p["point"]["measured_seconds"])
            for f, p in zip(programs, estimated, strict=True)]  # fmt: skip
    training = [r for r, p, f in zip(rows, estimated, programs, strict=True)
                if p["point"]["role"] == "fit" and not f.upper_bound]  # fmt: skip
    if coefficients is None:
        coefficients = fit(training)
    elif training:
        raise ValueError("coefficients: given for points some of which are to be fitted")
    table = []
    for (values, measured), p, f in zip(rows, estimated, programs, strict=True):
        calibrated = predicted_seconds(values, coefficients)
        table.append({"name": p["point"]["name"], "role": p["point"]["role"],
                      "timing": p["point"]["timing"], "source": p["point"]["source"],
                      "kind": declared_kind(f, coefficients, p["point"].get("kind")),
                      "measured_seconds": measured,
                      "static_seconds": p["estimate"]["step_seconds_scheduled"],
                      "calibrated_seconds": calibrated,
                      "static_ratio": p["estimate"]["step_seconds_scheduled"] / measured,
                      "calibrated_ratio": calibrated / measured})  # fmt: skip
    failed = [{"name": p["point"]["name"], "error": p.get("error") or "no estimate"}
              for p in points if not p.get("estimate")]  # fmt: skip
    return {"coefficients": coefficients, "bands": bands(table), "points": table,
            "failed": failed, "versions": dict(versions)}  # fmt: skip


def bands(table: Sequence[Mapping]) -> dict[str, dict[str, float | int | None]]:
    """Per kind (`KINDS`): ``band``, the largest relative error of the calibrated time over
    its points; ``fit`` and ``held_out``, the same over its fitted and its validation points
    only; ``points``, how many; ``static_ratio``, the least and most static/measured (the
    raw estimate's error)."""
    out: dict[str, dict[str, float | int | None]] = {}
    for name in KINDS:
        mine = [p for p in table if p["kind"] == name]
        errors = [abs(p["calibrated_ratio"] - 1) for p in mine]
        fit = [abs(p["calibrated_ratio"] - 1) for p in mine if p["role"] == "fit"]
        held = [abs(p["calibrated_ratio"] - 1) for p in mine if p["role"] == "validate"]
        ratios = [p["static_ratio"] for p in mine]
        out[name] = {"band": max(errors, default=None), "fit": max(fit, default=None),
                     "held_out": max(held, default=None), "points": len(mine),
                     "static_ratio_min": min(ratios, default=None),
                     "static_ratio_max": max(ratios, default=None)}  # fmt: skip
    return out


def committed_path(generation: str) -> importlib.resources.abc.Traversable:
    """Where the committed calibration of a TPU generation lives (package data)."""
    return (
        importlib.resources.files("pallas_flash_estimate")
        / "data"
        / f"calibration-{generation}.json"
    )


BANDS_FROM = {"v5e": "v5p"}
"""A generation none of whose attention kernels was ever timed, and the generation with the
same MXUs (four 128-wide, one row a cycle) whose bands of `BORROWED_KINDS` it takes."""

BORROWED_KINDS = (ATTENTION, ATTENTION_BACKWARD)

COEFFICIENTS_FROM = {"v7x": "v6e"}
"""A generation only validated: no coefficient is fitted on its points; it is calibrated by
the coefficients of the generation with the same MXUs (two 256-wide, two rows a cycle), and
its bands show how the model carries to a generation it never saw."""


def load(generation: str) -> dict | None:
    """The committed calibration of a TPU generation (`with_borrowed_bands`), or None if it
    has none."""
    path = committed_path(generation)
    return with_borrowed_bands(json.loads(path.read_text())) if path.is_file() else None


def with_borrowed_bands(found: dict) -> dict:
    """A calibration whose kinds of `BORROWED_KINDS` without a point take the band of
    `BANDS_FROM`'s generation (committed) where it has points, marked with it
    (``bands[kind]["generation"]``)."""
    found = dict(found, bands=dict(found["bands"]))
    donor = load(BANDS_FROM[found["generation"]]) if found["generation"] in BANDS_FROM else None
    for name in BORROWED_KINDS if donor else ():
        lent = donor["bands"].get(name, {})
        if lent.get("points") and not found["bands"].get(name, {}).get("points"):
            found["bands"][name] = dict(lent, generation=donor["generation"])
    return found


def describe(calibration: Mapping) -> str:
    """``fitted on 9 of 30 published v5e measurements, libtpu 0.0.42.1``, or for a generation
    only validated ``v6e's coefficients, validated on 114 measured v7x programs, ...``."""
    points = calibration["points"]
    libtpu = calibration["versions"].get("libtpu")
    donor = calibration.get("coefficients_from")
    if donor:
        return (f"{donor}'s coefficients, validated on {len(points)} measured "
                f"{calibration['generation']} programs (none fitted), libtpu {libtpu}")  # fmt: skip
    fitted = sum(1 for p in points if p["role"] == "fit")
    return (f"fitted on {fitted} of {len(points)} published {calibration['generation']} "
            f"measurements, libtpu {libtpu}")  # fmt: skip


def calibrate(
    program: ProgramFeatures, generation: str, declared: str | None = None
) -> CalibratedTime | None:
    """A program's calibrated device time and band, by the committed calibration of
    ``generation`` (None: it has none); ``declared``: its kind where the caller knows it
    (``train step``), else read from the program (`kind`)."""
    calibration = load(generation)
    if calibration is None:
        return None
    coefficients = calibration["coefficients"]
    name = declared_kind(program, coefficients, declared)
    band = calibration["bands"].get(name, {}).get("band")
    seconds = device_seconds(program, coefficients)
    return CalibratedTime(seconds, band, name, describe(calibration))


def level_band(calibration: Mapping | None, name: str = "MXU-bound") -> float:
    """The band within which two estimates of kind ``name`` are level: the calibrated band,
    or the widest of any kind where that kind has no point; NaN with no calibration."""
    if calibration is None:
        return math.nan
    known = [b["band"] for b in calibration["bands"].values() if b["band"] is not None]
    band = calibration["bands"].get(name, {}).get("band")
    return band if band is not None else max(known, default=math.nan)
