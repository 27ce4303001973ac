"""The static estimate of a whole program (a model's train or decode step) on one chip.

Every op the program runs (a Pallas kernel, an XLA fusion, a copy) is charged

    runs x max(static seconds, HBM seconds)

- ``runs``: how often the op executes in one step (`program_loops`: a scanned layer's ops
  once per layer; an op in a conditional's branch, every time unless the caller gives the
  branches' shares, then that share of the runs: a mean);
- static seconds: the executed bundles of its listing in the LLO dump (`llo.load_dump`)
  over the clock, or its busiest MXU's cycles when those are more; a Pallas kernel as the
  kernel rows charge it (`spread.kernel_entry`, with the attention shape it runs, so a
  causal kernel's skipped blocks are not charged). The dump holds one listing per distinct
  program: an op without its own takes that of the op with its `signature` (an unrolled
  layer's ops, the first layer's);
- HBM seconds: the bytes it moves through HBM (`op_bytes`) over the bandwidth, a floor for
  the ops a bundle count misses: elementwise fusions and the optimiser update wait on
  memory, not on issue slots. A decode kernel over ragged lengths reads only the blocks
  that hold cached tokens (it copies none past a sequence's end): its operands' bytes are
  charged on that share of its grid, as its static cycles are.

Collectives are left out here and modelled by `ici` (their schedules only wait); the step is
given at both ends of their overlap with the compute, and as the compiled schedule places
them (`overlap`). Asynchronous copies (weights prefetched into VMEM) are charged their HBM
time in the compute; the schedule's replay runs them beside the ops instead, on the HBM time
the ops leave unused (`overlap`), as does the all-hidden end; the none-hidden end keeps them
serial. Ops of a loop whose trip count the HLO does not give are counted once and
listed (``undetermined``); ops no listing matches are charged their HBM time only and listed
too.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

from pallas_flash_estimate.cost import kernel_cost, llo, op_bytes, overlap, spread
from pallas_flash_estimate.evaluate import program_loops
from pallas_flash_estimate.program import ici, sanity
from pallas_flash_estimate.read import hlo, hlo_ops
from pallas_flash_estimate.targets import SENSITIVITY, Target

ANALYSIS_VERSION = 14
"""The estimator's analysis version: bump it when any stage's analysis changes (what a
compile is read into, or how it is costed). Every result made with the estimator carries it
(the bench's cache keys, its committed results files, the calibration, the committed MaxText
analyses), so results of an older analysis are remade, not mixed with new ones."""

ENDS = ("overlapped", "scheduled", "exposed")
"""The step's ends: collectives (and copies) hidden, as the schedule places them, exposed."""

TOP_OPS = 12
"""How many of a program's heaviest ops its estimate lists (``top_ops``)."""


@dataclasses.dataclass(frozen=True)
class OpTime:
    """One scheduled op's share of a step."""

    name: str
    kind: str  # "kernel" (Pallas), "matmul" (MXU-bound XLA op) or "other"
    runs: float  # a mean where a branch's share counts it
    static_seconds: float  # one run
    hbm_seconds: float  # one run
    inner_loops_counted_once: bool = False  # its schedule has loops of unknown trip count
    grid_steps: int = 0  # a Pallas kernel's grid steps in one run (0: not a kernel)
    dma_bytes: int = 0  # a Pallas kernel's block copies in one run, at most
    undecided_seconds: float = 0.0  # a kernel's regions the schedule cannot decide, one run
    unknown_grid: bool = False  # a Pallas kernel whose grid steps no one knows (run once)
    implausible: str | None = None  # why its rooflines refuse its figure (`sanity`), one run

    @property
    def seconds(self) -> float:
        """All its runs, each the larger of its static and HBM time."""
        return self.runs * max(self.static_seconds, self.hbm_seconds)


_NO_CODE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                      "after-all", "partition-id", "replica-id", "opt-barrier", "while",
                      "conditional", "call"})  # fmt: skip
"""Opcodes that run no program of their own (bookkeeping, or control whose body is counted)."""


def _stem(name: str) -> str:
    return re.sub(r"(\.\d+)+$", "", name)


def signature(op: hlo.HloOp, comps: Mapping[str, hlo.Computation],
              shapes: Mapping[str, str]) -> tuple:  # fmt: skip
    """What makes two ops one compiled program: name stem, opcode, shapes of result and
    operands, for a fusion its fused ops' opcodes and shapes and for a Pallas kernel its
    serialized Mosaic body (a causal and an unmasked kernel on the same shapes are two
    programs). The LLO dump holds one listing per distinct program (an unrolled layer's
    fusions share the first layer's)."""
    fused = hlo.fused_computation(op, comps)
    body = tuple((o.opcode, o.shape) for o in fused.ops) if fused is not None else ()
    operands = tuple(shapes.get(n, "") for n in op.operands)
    return (_stem(op.name), op.opcode, op.shape, operands, body, hlo_ops.kernel_body(op))


def _charged(op: hlo.HloOp) -> bool:
    """Whether an op of a sequential computation is charged here: not bookkeeping, not a
    collective (`ici` models those), not the second half of an asynchronous pair."""
    if op.opcode in _NO_CODE or op.opcode.endswith("-done"):
        return False
    base = op.opcode.removesuffix("-start")
    return base not in hlo_ops.COLLECTIVES and not op.opcode.startswith("async")


def op_times(
    comps: Mapping[str, hlo.Computation],
    runs: program_loops.ProgramRuns,
    schedules: Mapping[str, llo.KernelSchedule],
    kernel_workload: Callable[[str], kernel_cost.Occupancy],
    target: Target,
) -> tuple[list[OpTime], list[str]]:
    """`OpTime` of every op the program runs but its collectives (``comps`` and ``runs``: its
    `hlo.parse_computations` and `program_loops.program_runs`), and the ops no listing of the
    dump matches (charged their HBM bytes only).
    ``kernel_workload(kernel name)``: the attention shape a Pallas kernel runs."""
    ops = [op for comp in _sequential(comps, runs) for op in comp.ops]
    shapes = {op.name: op.shape for comp in comps.values() for op in comp.ops}
    by_signature = {}
    for op in ops:
        if op.name in schedules:
            by_signature.setdefault(signature(op, comps, shapes), schedules[op.name])
    cycles_of: dict[str, tuple[int, str, float]] = {}
    out, unmatched = [], []
    for op in filter(_charged, ops):
        schedule = schedules.get(op.name) or by_signature.get(signature(op, comps, shapes))
        memory = op_bytes.op_hbm_bytes(op, comps, shapes) / target.hbm_bandwidth
        if schedule is None:
            unmatched.append(op.name)
            out.append(OpTime(op.name, "other", runs.runs(op.name), 0.0, memory))
            continue
        if schedule.name not in cycles_of:
            kernel = hlo_ops.is_kernel_call(op)
            cycles_of[schedule.name] = _cycles(schedule, kernel, kernel_workload)
        c = cycles_of[schedule.name]
        once = c.kind != "kernel" and schedule.executed_bundles_max is None
        static = c.cycles / target.clock_hz
        declared = (hlo_ops.cost_estimate(op) or {}).get("flops") if c.kind == "kernel" else None
        mxu = None if c.mxu_cycles is None else c.mxu_cycles / target.clock_hz
        refused = sanity.implausible(op.name, static, mxu, declared, target.peak_flops)
        out.append(OpTime(op.name, c.kind, runs.runs(op.name), static, memory * c.read, once,
                          c.grid_steps, c.dma_bytes, c.undecided_cycles / target.clock_hz,
                          c.unknown_grid, refused))  # fmt: skip
    return out, unmatched


@dataclasses.dataclass(frozen=True)
class _ListingCost:
    cycles: int  # static cycles of one run
    kind: str  # see `OpTime.kind`
    read: float  # the share of its operands' bytes it reads
    grid_steps: int = 0
    dma_bytes: int = 0
    undecided_cycles: int = 0  # in regions the schedule cannot decide
    unknown_grid: bool = False  # its grid's steps are not known (charged one)
    mxu_cycles: int | None = None  # a kernel's busiest MXU's, one run


def _cycles(
    schedule: llo.KernelSchedule,
    kernel: bool,
    kernel_workload: Callable[[str], kernel_cost.Occupancy],
) -> _ListingCost:
    """The cost of one run of a listing: a kernel as the kernel rows charge it, reading the
    share of its cache a ragged decode's lengths fill, by the block or by the page as it
    copies (`kernel_cost.copied_fraction`), with its grid steps and block copies."""
    if kernel:
        workload = kernel_workload(schedule.name)
        trips = workload.loop_trips if isinstance(workload, kernel_cost.FullGrid) else None
        entry = spread.kernel_entry(schedule, workload, trips)
        read = kernel_cost.copied_fraction(schedule.name, schedule.grid, workload)
        steps = trips[0] if trips else entry["steps"]  # a grid sized at run time: as given
        # undecided regions charged in full: only where no occupancy says how often they run
        full = (isinstance(workload, kernel_cost.FullGrid) and entry["undecided_bundles"]) or 0
        # where the occupancy is the whole grid (`estimate_program`'s): a grid sized at run
        # time from values the program does not hold as constants, and no trips given
        unknown = isinstance(workload, kernel_cost.FullGrid) and not trips
        unknown = unknown and schedule.grid_steps is None and schedule.trip_count is None
        return _ListingCost(entry["cycles"], "kernel", read, steps, entry["dma_bytes"] or 0, full,
                            unknown, entry["estimates"].get("mxu"))  # fmt: skip
    if schedule.executed_bundles_max is None:
        return _ListingCost(schedule.bundles, "other", 1.0)
    mxu = schedule.executed_mxu_cycles_max or 0
    kind = "matmul" if mxu > schedule.executed_bundles_max else "other"
    return _ListingCost(max(schedule.executed_bundles_max, mxu), kind, 1.0)


ASYNC_COPIES = ("copy-start", "slice-start")
"""Opcodes of the copies XLA starts ahead of their use (weights prefetched into VMEM, buffers
evicted to HBM) and awaits at their ``-done``: `overlap` replays them beside the ops."""


def _sequential(
    comps: Mapping[str, hlo.Computation], runs: program_loops.ProgramRuns
) -> list[hlo.Computation]:
    """The program's sequential computations in the order of its text: every sum and list
    over their ops comes out the same from one run to the next."""
    return [comp for comp in comps.values() if comp.name in runs.sequential]


def _async_copies(comps: Mapping[str, hlo.Computation],
                  runs: program_loops.ProgramRuns) -> list[str]:  # fmt: skip
    return [op.name for comp in _sequential(comps, runs) for op in comp.ops
            if op.opcode in ASYNC_COPIES]  # fmt: skip


def program_estimate(
    text: str,
    schedules: Mapping[str, llo.KernelSchedule],
    kernel_workload: Callable[[str], kernel_cost.Occupancy],
    target: Target,
    chips: int,
    branch_shares: program_loops.BranchShares | None = None,
    sensitivity: bool = True,
) -> dict:
    """A step's static estimate on one chip of ``chips`` (``branch_shares``: how often a
    conditional's branches run, `program_loops.program_runs`): compute seconds by kind of op
    (`op_times`; asynchronous copies charged in full), the compute with the copies
    overlapped as scheduled, the collectives (`ici`), the step as the schedule overlaps
    collectives and copies (`overlap`) and at both ends: collectives hidden under the compute
    with its copies as scheduled, and nothing hidden, copies serial; and what the estimate
    could not count. The program is read once; each variant of ``target`` in the
    sensitivity sweep (`targets.SENSITIVITY`) is costed on that reading."""
    comps = hlo.parse_computations(text)
    runs = program_loops.program_runs(text, comps, branch_shares)
    keys = program_loops.collective_keys(comps, runs)
    program = _Program(comps, runs, keys, program_loops.collective_groups(comps, runs, keys))
    found = _cost(program, schedules, kernel_workload, target, chips)
    if sensitivity:  # the same step with each assumed constant moved (`targets.SENSITIVITY`)
        found["sensitivity"] = {}
        for name, moved in SENSITIVITY.items():
            again = _cost(program, schedules, kernel_workload, moved(target), chips)
            found["sensitivity"][name] = {end: again[f"step_seconds_{end}"] for end in ENDS}
    return found


class CompiledProgram(Protocol):
    """What this stage reads of a compiled program (`aot.compiled.Compiled`): the record of
    the compile (``result``), its optimised HLO ``text`` and its listings by op name
    (``schedules``; both None where it did not compile or no dump was asked for)."""

    result: dict
    text: str | None
    schedules: Mapping[str, llo.KernelSchedule] | None


def compiled_estimate(
    compiled: CompiledProgram,
    kernel_workload: Callable[[str], kernel_cost.Occupancy],
    target: Target,
    chips: int,
    branch_shares: program_loops.BranchShares | None = None,
    sensitivity: bool = True,
) -> dict:
    """What `aot.compiled.compile_program` recorded of a program, with its ``estimate``
    (`program_estimate` of its HLO and listings, each Pallas kernel charged as
    ``kernel_workload`` says by op name, the sensitivity sweep with ``sensitivity``);
    unchanged where it has no listings (it did not compile, or no dump was asked for)."""
    if compiled.text is None or compiled.schedules is None:
        return compiled.result
    found = program_estimate(compiled.text, compiled.schedules, kernel_workload, target, chips,
                             branch_shares, sensitivity)  # fmt: skip
    return {**compiled.result, "estimate": found}


class _Program(NamedTuple):
    """What `program_estimate` reads of a program, whatever the target's constants."""

    comps: dict[str, hlo.Computation]
    runs: program_loops.ProgramRuns
    keys: dict[str, str]  # collective -> its group (`program_loops.collective_keys`)
    groups: dict  # group -> its collectives (`program_loops.collective_groups`)


def _cost(
    program: _Program,
    schedules: Mapping[str, llo.KernelSchedule],
    kernel_workload: Callable[[str], kernel_cost.Occupancy],
    target: Target,
    chips: int,
) -> dict:
    """`program_estimate`'s figures for one target."""
    comps, runs, keys, groups = program
    times, unmatched = op_times(comps, runs, schedules, kernel_workload, target)
    collectives = ici.program_collectives(groups.values(), chips, target)
    by_kind = {kind: sum(t.seconds for t in times if t.kind == kind)
               for kind in ("kernel", "matmul", "other")}  # fmt: skip
    compute = sum(by_kind.values())
    exchange = sum(c["seconds"] for c in collectives)
    each = {key: c["seconds"] / max(c["runs"], 1)
            for key, c in zip(groups, collectives, strict=True)}  # fmt: skip
    one_run = {t.name: max(t.static_seconds, t.hbm_seconds) for t in times}
    copies = {name: one_run.pop(name) for name in _async_copies(comps, runs)}
    hbm = {t.name: t.hbm_seconds for t in times}
    replay = functools.partial(overlap.ScheduleReplay, comps, runs, keys, one_run,
                               copy_seconds=copies, op_hbm_seconds=hbm)  # fmt: skip
    copies_overlapped = replay({}).replay()  # the compute alone, its copies as scheduled
    scheduled = replay(each).replay()
    hidden = ici.step_bounds(copies_overlapped, exchange)[0]
    exposed = ici.step_bounds(compute, exchange)[1]
    memory_bound = sum(t.seconds for t in times if t.hbm_seconds > t.static_seconds)
    loops = [t.name for t in times if t.inner_loops_counted_once]
    heaviest = sorted(times, key=lambda t: (-t.seconds, t.name))[:TOP_OPS]
    kernels = [t for t in times if t.kind == "kernel"]
    fill = sum(t.runs * t.dma_bytes / max(t.grid_steps, 1) for t in kernels)
    found = {
        "compute_seconds": compute,
        "compute_seconds_copies_overlapped": copies_overlapped,
        "async_copy_seconds": sum(t.seconds for t in times if t.name in copies),
        "seconds_by_kind": by_kind,
        "memory_bound_seconds": memory_bound,
        "collective_seconds": exchange,
        "step_seconds_overlapped": hidden,
        "step_seconds_exposed": exposed,
        "step_seconds_scheduled": scheduled,
        "ops": len(times),
        "loop_trips": runs.trips,
        "branch_shares": runs.shares,
        "undetermined_loops": runs.undetermined,
        "ops_with_unknown_inner_loops": loops,
        "ops_without_listing": unmatched,
        "collectives": collectives,
        "kernel_grid_steps": sum(t.runs * t.grid_steps for t in kernels),
        "kernel_dma_seconds": sum(t.runs * t.dma_bytes for t in kernels) / target.hbm_bandwidth,
        # each kernel run's first block, which nothing before it hides: its copies over a step
        "kernel_fill_seconds": fill / target.hbm_bandwidth,
        # charged in full where the kernel's occupancy does not say how often they run
        "kernel_undecided_seconds": sum(t.runs * t.undecided_seconds for t in kernels),
        "kernels_of_unknown_grid": sorted({t.name for t in kernels if t.unknown_grid}),
        "implausible_ops": sorted({t.implausible for t in times if t.implausible}),
        "top_ops": [dict(dataclasses.asdict(t), seconds=t.seconds) for t in heaviest],
    }
    return found
