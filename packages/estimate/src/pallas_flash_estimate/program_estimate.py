"""Estimate any JAX program for a TPU target: ``estimate_program(fn, *abstract_args)``.

For a kernel writer without a TPU: the program is compiled for one chip of the target with
libtpu on this host (`aot.compiled`, in a worker process whose libtpu writes the LLO dump:
`aot.worker`) and estimated as a whole (`program.whole_program`): every op by its own
listing, a Pallas kernel by its own listing over its whole grid (`cost.kernel_cost.FullGrid`:
every step and every region the schedule cannot decide charged), its memory from the
compiler's analysis. The calibration (`calibration`) turns the static figure into the time
the published v5e measurements say such a program takes, with the error band of its kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from pallas_flash_estimate import calibration
from pallas_flash_estimate.aot import worker
from pallas_flash_estimate.aot.program_ref import ProgramRef
from pallas_flash_estimate.program import sanity
from pallas_flash_estimate.targets import TARGETS, Target


class UnknownGridError(ValueError):
    """A Pallas kernel's grid is sized at run time from values the program does not hold as
    constants (a mask or lengths passed in as arguments): how often it runs is unknown, so no
    time can be given. ``kernels``: their op names."""

    def __init__(self, program: str, kernels: Sequence[str]):
        self.kernels = tuple(kernels)
        stems = ", ".join(f"{k.split('.')[0]!r}: (STEPS,)" for k in self.kernels)
        super().__init__(
            f"{program}: the grid (outermost loop) of Pallas kernel {', '.join(self.kernels)} "
            f"runs a number of times read at run time from values that are not constants of "
            f"the program, so how long it takes is unknown; pass estimate_program(..., "
            f"loop_trips={{{stems}}}): how often its loops without a trip count run, "
            f"outermost first (a grid sized at run time: its steps)"
        )


class ImplausibleEstimateError(ValueError):
    """The estimate is outside what the program's flops allow (`program.sanity`): a loop
    counted too few or too many times. ``reasons``: one per op, or the whole program's."""

    def __init__(self, program: str, reasons: Sequence[str]):
        self.reasons = tuple(reasons)
        super().__init__(
            f"{program}: no estimate: the counted loops do not explain it ({'; '.join(reasons)})"
        )


@dataclasses.dataclass(frozen=True)
class ProgramEstimate:
    """One program's estimate on one chip of ``target``; every time is in seconds.

    ``seconds``: the static estimate as the compiled schedule places the ops and their
    asynchronous copies (one bundle a cycle, an MXU-bound op at its busiest MXU, a
    memory-bound op at its HBM bytes over the bandwidth); ``bracket``: the same with every
    copy hidden and with none. ``calibrated``: what the calibration makes of it (None: no
    calibration for the target). ``seconds_by_kind``: Pallas kernels, MXU-bound XLA ops and
    other ops; ``grid_steps``: the Pallas kernels' grid steps; ``ops``: the heaviest ops
    (name, kind, runs, static and HBM seconds of one run); ``hbm``: argument, output, alias,
    temp and peak bytes; ``copies``: ops that change a layout; ``flops``: the compiler's
    count; ``notes``: what the estimate could not count.
    """

    program: str
    target: str
    seconds: float
    bracket: tuple[float, float]
    calibrated: calibration.CalibratedTime | None
    seconds_by_kind: Mapping[str, float]
    grid_steps: float
    ops: Sequence[Mapping[str, object]]
    hbm: Mapping[str, int]
    copies: Sequence[Mapping[str, object]]
    flops: float | None
    notes: Sequence[str]

    def summary(self) -> str:
        """A few lines for a terminal."""
        lo, hi = self.bracket
        lines = [f"{self.program} on one chip of {self.target}",
                 f"static estimate: {_ms(self.seconds)} (copies all hidden {_ms(lo)}, "
                 f"none hidden {_ms(hi)})"]  # fmt: skip
        if self.calibrated is not None:
            c = self.calibrated
            band = "no point of its kind" if c.band is None else f"± {c.band:.1%}"
            lines.append(f"calibrated: {_ms(c.seconds)} {band} ({c.kind}; {c.calibration})")
        kinds = ", ".join(f"{k} {_ms(v)}" for k, v in self.seconds_by_kind.items() if v)
        lines.append(f"by kind: {kinds}; Pallas grid steps: {self.grid_steps:,.0f}")
        lines.append(f"HBM at peak: {self.hbm['peak'] / 2**20:,.1f} MiB")
        for o in self.ops:
            one = max(o["static_seconds"], o["hbm_seconds"])
            lines.append(f"  {o['name']}: {o['runs']:g} x {_ms(one)} ({o['kind']})")
        lines += [f"copy: {c['name']} {c['opcode']} {c['shape']}" for c in self.copies]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def from_analysis(result: Mapping, ref: ProgramRef, target: Target) -> ProgramEstimate:
    """The `ProgramEstimate` of a worker's result (`aot.worker.analyse`); raises the
    compiler's error, `UnknownGridError` for a kernel whose grid steps are unknown, and
    `ImplausibleEstimateError` for an estimate its flops refuse (`program.sanity`)."""
    if "job_error" in result:
        raise RuntimeError(f"{ref.label}: the worker failed: {result['job_error']}")
    if not result["compiled"]:
        raise RuntimeError(f"{ref.label} did not compile for {target.name}: {result['error']}")
    e = result["estimate"]
    if e.get("kernels_of_unknown_grid"):
        raise UnknownGridError(ref.label, e["kernels_of_unknown_grid"])
    whole = sanity.implausible("the program", e["step_seconds_scheduled"], None,
                               result.get("flops"), target.peak_flops)  # fmt: skip
    refused = [*e.get("implausible_ops", ()), *([whole] if whole else [])]
    if refused:
        raise ImplausibleEstimateError(ref.label, refused)
    notes = list(result["notes"])
    if e["ops_without_listing"]:
        notes.append(f"ops without a listing, charged their HBM bytes only: "
                     f"{', '.join(e['ops_without_listing'])}")  # fmt: skip
    if e["ops_with_unknown_inner_loops"]:
        notes.append(f"ops with loops of unknown trip count, counted once (a lower bound): "
                     f"{', '.join(e['ops_with_unknown_inner_loops'])}")  # fmt: skip
    if e["undetermined_loops"]:
        notes.append(f"loops of unknown trip count, run once: {', '.join(e['undetermined_loops'])}")
    return ProgramEstimate(
        program=ref.label,
        target=target.name,
        seconds=e["step_seconds_scheduled"],
        bracket=(e["step_seconds_overlapped"], e["step_seconds_exposed"]),
        calibrated=calibration.calibrate(
            calibration.ProgramFeatures.of_estimate(e), target.generation
        ),
        seconds_by_kind=e["seconds_by_kind"],
        grid_steps=e["kernel_grid_steps"],
        ops=e["top_ops"],
        hbm=result["hbm"],
        copies=result["copies"],
        flops=result["flops"],
        notes=notes,
    )


def estimate_program(
    fn: Callable,
    *args: object,
    target: str | Target = "v5e-1",
    loop_trips: Mapping[str, Sequence[int]] | None = None,
    **kwargs: object,
) -> ProgramEstimate:
    """The static estimate of ``fn(*args, **kwargs)`` on one chip of ``target``.

    ``fn``: a function defined at the top level of an importable module (plain or jitted;
    it is compiled in a worker process, which imports it); ``args``: abstract arrays
    (``jax.ShapeDtypeStruct``) or arrays, whose shapes and dtypes are all that is used;
    ``kwargs``: static keyword arguments (JSON values). Needs libtpu (``jax[tpu]``); no TPU.

    A Pallas kernel whose grid is sized at run time (a block-sparse mask's active blocks) is
    counted from the program's constants: the grid's size and the tables that decide what
    each step runs (a mask built with NumPy at trace time). Where the program does not hold
    them, it raises `UnknownGridError` unless ``loop_trips`` gives, per kernel name (without
    its ``.N``), how often its loops without a trip count run, outermost first. An estimate
    that the flops of its ops refuse (a kernel under its flops at peak, or its counted MXU
    work far over them: `program.sanity`) raises `ImplausibleEstimateError` instead of a
    number the program cannot take.
    """
    if isinstance(target, str):
        if target not in TARGETS:
            known = ", ".join(sorted(TARGETS))
            raise ValueError(f"target: expected one of {known}, got {target!r}")
        target = TARGETS[target]
    ref = ProgramRef.of(fn, args, kwargs)
    trips = tuple(sorted((name, tuple(runs)) for name, runs in (loop_trips or {}).items()))
    return estimate_ref(dataclasses.replace(ref, loop_trips=trips), target)


def estimate_ref(ref: ProgramRef, target: Target) -> ProgramEstimate:
    """`estimate_program` of a program given by reference (``pallas-flash estimate``)."""
    return from_analysis(worker.run(ref, target), ref, target)
