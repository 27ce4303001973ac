"""A kernel's static schedule from its libtpu LLO dump: a `KernelSchedule` per compiled HLO op.

`load_dump` reads a dump folder (`read.dump_files`): per op, its bundle listing
(`evaluate.bundle_listing`), its per-bundle utilization and schedule analysis, and
when dumped its memory allocations (the VMEM a kernel uses) and critical path
(`read.critical_path`). `build_schedule` sums them up: the grid loop's bundles,
slots and spills, and the bundles the whole kernel executes (one per cycle: static cycles).

Any other per-bundle figure is weighed like the executed bundles by :func:`executed_weight` (the
busiest MXU's cycles, the critical path of `read.critical_path`), an instruction's
executions counted by :func:`executed_instruction` (the DMAs of `cost.dma`).

No JAX import: this module only reads text.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from pallas_flash_estimate.evaluate.bundle_listing import (
    BundleListing,
    Loop,
    executed_in_loop,
    hlo_opcode,
    parse_bundles,
)
from pallas_flash_estimate.evaluate.bundle_weights import covered
from pallas_flash_estimate.read import critical_path
from pallas_flash_estimate.read.dump_files import (
    ScheduleAnalysis,
    Utilization,
    find_dump_files,
    kernel_operands,
    op_name,
    parse_grid,
    parse_schedule_analysis,
    parse_utilization,
    parse_vmem_bytes,
)

__all__ = [
    "KernelSchedule",
    "build_schedule",
    "executed_instruction",
    "executed_weight",
    "is_pallas_kernel",
    "load_dump",
    "load_kernel",
]

_SPILL_RE = re.compile(r"\[(?:vmem|smem):\[#allocation\d+_spill")


@dataclasses.dataclass(frozen=True)
class KernelSchedule:
    name: str  # op name from the file name, e.g. "flash_attention.1"
    bundles: int  # total bundles
    loops: tuple[Loop, ...]
    grid: tuple[int, ...] | None  # see BundleListing.grid
    units: tuple[str, ...]  # from the utilization header (empty without a utilization file)
    capacity: dict[str, int]
    used: dict[str, int]  # slots used over the grid loop body (whole kernel without a loop)
    spill_stores: int  # vector stores to spill slots, grid loop body
    fill_loads: int  # vector loads from spill slots, grid loop body
    mxu_ops: int  # vmatmul instructions, grid loop body
    warnings: tuple[str, ...]
    scalar_spill_stores: int = 0  # sst to spill slots, grid loop body
    scalar_fill_loads: int = 0  # sld from spill slots, grid loop body
    opcodes: dict[str, int] = dataclasses.field(default_factory=dict)  # base mnemonic counts, body
    used_total: dict[str, int] = dataclasses.field(default_factory=dict)  # whole kernel
    hlo: str | None = None  # HLO instruction (schedule analysis, else the exit bundle comment)
    hlo_opcode: str | None = None  # "custom-call", "fusion", "copy", ...
    custom_call_target: str | None = None  # "tpu_custom_call" for Mosaic (Pallas) kernels
    # Bundles the whole kernel executes (one bundle issues per cycle: static cycles, no stalls),
    # regions undecided from the schedule skipped (min) or run (max); None with inner loops or
    # an unknown trip count.
    executed_bundles_min: int | None = None
    executed_bundles_max: int | None = None
    # Cycles the busiest MXU is kept busy by the executed vmatmuls (per loop; see
    # bundle_weights.mxu_cycles): when above the executed bundles the kernel is
    # MXU-bound and the bundle count underestimates its time.
    executed_mxu_cycles_min: int | None = None
    executed_mxu_cycles_max: int | None = None
    vmem_bytes: int | None = None  # VMEM the kernel allocates (None without the allocation list)
    listing: BundleListing | None = dataclasses.field(default=None, repr=False, compare=False)
    # The compiler's critical path per basic block (None without a critical-path file).
    critical_path: tuple[critical_path.Block, ...] | None = dataclasses.field(
        default=None, repr=False
    )

    @property
    def executed_bundles(self) -> int | None:
        """Bundles the whole kernel executes, when every region was decided."""
        lo, hi = self.executed_bundles_min, self.executed_bundles_max
        return lo if lo is not None and lo == hi else None

    @property
    def grid_loop(self) -> Loop | None:
        """The outermost loop with the most bundles (a Pallas kernel's grid loop)."""
        outer = [lp for lp in self.loops if lp.depth == 1]
        return max(outer, key=lambda lp: (lp.bundles, -lp.start)) if outer else None

    @property
    def bundles_per_step(self) -> int:
        """Bundles of the grid loop body (delay slots of the back-edge included)."""
        loop = self.grid_loop
        return loop.bundles if loop is not None else self.bundles

    @property
    def trip_count(self) -> int | None:
        """Executions of the grid loop body (grid steps + pipeline fill/drain); 1 without loop."""
        loop = self.grid_loop
        return loop.trip_count if loop is not None else 1

    @property
    def grid_steps(self) -> int | None:
        return math.prod(self.grid) if self.grid is not None else None

    @property
    def predicated_bundles(self) -> int:
        """Skippable bundles of the grid loop body (see :attr:`Loop.predicated_bundles`)."""
        loop = self.grid_loop
        return loop.predicated_bundles if loop is not None else 0

    def utilization(self, unit: str) -> float:
        """Fraction of ``unit``'s slots used over one grid step, all regions executed."""
        cap = self.capacity[unit]
        steps = self.bundles_per_step
        return self.used[unit] / (cap * steps) if cap and steps else 0.0


def build_schedule(
    listing: BundleListing,
    utilization: Utilization | None = None,
    analysis: ScheduleAnalysis | None = None,
) -> KernelSchedule:
    warnings = list(listing.warnings)
    n = len(listing.bundles)
    loops = listing.loops
    outer = [lp for lp in loops if lp.depth == 1]
    grid_loop = max(outer, key=lambda lp: (lp.bundles, -lp.start)) if outer else None
    lo, hi = (grid_loop.start, grid_loop.end) if grid_loop else (0, n - 1)

    units: tuple[str, ...] = ()
    capacity: dict[str, int] = {}
    used: dict[str, int] = {}
    used_total: dict[str, int] = {}
    if utilization is None:
        warnings.append("no utilization file")
    else:
        warnings.extend(utilization.warnings)
        if len(utilization.rows) != n:
            warnings.append(f"utilization has {len(utilization.rows)} rows for {n} bundles")
        units, capacity = utilization.units, dict(utilization.capacity)
        used = utilization.summed(lo, hi)
        used_total = utilization.summed()
    if analysis is not None and analysis.total is not None and analysis.total != n:
        warnings.append(f"schedule analysis reports {analysis.total} bundles, parsed {n}")

    counts: dict[str, int] = {}
    spills = {"vst": 0, "vld": 0, "sst": 0, "sld": 0}
    mxu = 0
    for b in listing.bundles[lo : hi + 1]:
        for ins in b.instructions:
            base = ins.base
            counts[base] = counts.get(base, 0) + 1
            if base == "vmatmul":
                mxu += 1
            if base in spills and _SPILL_RE.search(ins.args):
                spills[base] += 1

    # Whole-kernel executed bundles: straight-line code once, loops by their own accounting.
    top = [lp for lp in loops if lp.depth == 1]
    in_loops = [(lp.start, lp.end) for lp in top]
    outside = n - sum(lp.bundles for lp in top)
    skippable = covered(
        (r.start, r.end)
        for r in listing.regions
        if not any(s <= r.branch <= e for s, e in in_loops)
    )
    ex_lo = ex_hi = mxu_lo = mxu_hi = None
    if all(lp.executed_bundles_min is not None for lp in top):
        ex_lo = outside - skippable + sum(lp.executed_bundles_min or 0 for lp in top)
        ex_hi = outside + sum(lp.executed_bundles_max or 0 for lp in top)
        mxu_lo, mxu_hi = executed_weight(listing, listing.mxu_prefixes.values()) or (None, None)

    hlo = analysis.hlo if analysis is not None and analysis.hlo else listing.hlo
    return KernelSchedule(
        name=listing.name,
        bundles=n,
        loops=loops,
        grid=listing.grid,
        units=units,
        capacity=capacity,
        used=used,
        spill_stores=spills["vst"],
        fill_loads=spills["vld"],
        mxu_ops=mxu,
        warnings=tuple(warnings),
        scalar_spill_stores=spills["sst"],
        scalar_fill_loads=spills["sld"],
        opcodes=dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        used_total=used_total,
        hlo=hlo,
        hlo_opcode=hlo_opcode(hlo) or listing.hlo_opcode,
        custom_call_target=analysis.custom_call_target if analysis is not None else None,
        executed_bundles_min=ex_lo,
        executed_bundles_max=ex_hi,
        executed_mxu_cycles_min=mxu_lo,
        executed_mxu_cycles_max=mxu_hi,
        listing=listing,
    )


def executed_weight(
    listing: BundleListing, prefixes: Iterable[list[int]]
) -> tuple[int, int] | None:
    """(min, max) over the whole kernel of the busiest of per-bundle weights (each given as
    `bundle_weights.prefix_sums`), weighed like the executed bundles: straight-line code once,
    each loop's bundles by the iterations that run them, undecided regions skipped (min) or run
    (max). The busiest weight outside the loops plus, per loop, its busiest. None with inner
    loops or an unknown trip count."""
    prefixes = list(prefixes)
    n = len(listing.bundles)
    top = [lp for lp in listing.loops if lp.depth == 1]
    if any(lp.context is None for lp in top):
        return None
    in_loops = [(lp.start, lp.end) for lp in top]
    outer_spans = _uncovered(n, in_loops)
    outer_regions = [
        (r.start, r.end)
        for r in listing.regions
        if not any(s <= r.branch <= e for s, e in in_loops)
    ]
    straight = [(covered(outer_spans, p), covered(outer_regions, p)) for p in prefixes]
    lo = max((a - b for a, b in straight), default=0)
    hi = max((a for a, _ in straight), default=0)
    for lp in top:
        ctx = lp.context
        assert ctx is not None
        busy = [executed_in_loop((lp.start, lp.end), ctx.spans, ctx.result, p) for p in prefixes]
        lo += max((b[0] for b in busy), default=0)
        hi += max((b[1] for b in busy), default=0)
    return lo, hi


def executed_instruction(
    listing: BundleListing, index: int, guard: str | None
) -> tuple[int, int] | None:
    """(min, max) times an instruction of bundle ``index`` with predicate ``guard`` (``%p3``:
    runs when ``%p3`` holds; ``!%p3``: when it does not) runs over the whole kernel, undecided
    predicates taken as false (min) or true (max). None inside a loop without evaluation."""
    loop = min(
        (lp for lp in listing.loops if lp.start <= index <= lp.end),
        key=lambda lp: lp.bundles,
        default=None,
    )
    if loop is None:
        regions = [r for r in listing.regions if r.start <= index <= r.end]
        return (0, 1) if regions or guard is not None else (1, 1)
    ctx = loop.context
    if ctx is None:
        return None
    enclosing = [k for k, (s, e) in enumerate(ctx.spans) if s <= index <= e]
    preds = [ctx.predicates[k] for k in enclosing]
    if guard is not None:
        preds.append(guard[1:] if guard.startswith("!") else "!" + guard)  # skipped unless it holds
    probe = ctx.evaluate(preds, [[]] * len(preds))
    decided = [p for p, k in zip(preds, probe.skipped, strict=True) if k is not None]
    hi = ctx.trip
    if decided:  # iterations skipping none of them: the last one's, the others its parents
        parents = [[] for _ in decided[1:]] + [list(range(len(decided) - 1))]
        hi = ctx.evaluate(decided, parents).executed[-1]
        assert hi is not None
    return (hi if len(decided) == len(preds) else 0), hi


def _uncovered(n: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The inclusive spans of bundles ``0..n-1`` outside ``spans``."""
    gaps, start = [], 0
    for s, e in sorted(spans):
        if s > start:
            gaps.append((start, s - 1))
        start = max(start, e + 1)
    if start < n:
        gaps.append((start, n - 1))
    return gaps


def _read(path: str | Path, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"LLO dump {what} file not found: {p}")
    return p.read_text(encoding="utf-8", errors="replace")


def load_kernel(
    bundles_path: str | Path,
    utilization_path: str | Path | None = None,
    analysis_path: str | Path | None = None,
    *,
    name: str | None = None,
    counter_grid: tuple[int, ...] | None = None,
    operands: Mapping[int, int | tuple[int, ...]] | None = None,
    mxu_rows_per_cycle: int = 1,
) -> KernelSchedule:
    """Load one kernel from its final_bundles file (and optional companions); ``counter_grid``,
    ``operands`` and ``mxu_rows_per_cycle`` as in `evaluate.bundle_listing.parse_bundles`.

    Raises :class:`FileNotFoundError` naming the path when a given file is missing.
    """
    text = _read(bundles_path, "final_bundles")
    util = parse_utilization(_read(utilization_path, "utilization")) if utilization_path else None
    ana = (
        parse_schedule_analysis(_read(analysis_path, "schedule-analysis"))
        if analysis_path
        else None
    )
    listing = parse_bundles(
        text,
        name or op_name(Path(bundles_path)),
        counter_grid=counter_grid,
        operands=operands,
        mxu_rows_per_cycle=mxu_rows_per_cycle,
    )
    return build_schedule(listing, util, ana)


def load_dump(dump_dir: str | Path, mxu_rows_per_cycle: int = 1) -> dict[str, KernelSchedule]:
    """Every op of a dump folder with a final_bundles file, keyed by op name; its MXUs take
    ``mxu_rows_per_cycle`` rows a cycle (the target's: `targets.Target.mxu_rows_per_cycle`).

    When several programs were dumped into one folder and an op name occurs in more than one,
    the first fingerprint (in sorted order) keeps the plain name, the others are keyed
    ``"<name>@<fingerprint>"``, and all of them carry a warning.

    A kernel's scalar operands that are constants in the dumped programs' HLO
    (`read.dump_files.kernel_operands`) size the loops that run to them: a grid sized at run time.
    """
    files = find_dump_files(dump_dir)
    operands = kernel_operands(dump_dir)
    out: dict[str, KernelSchedule] = {}
    for key, paths in files.items():
        name = key.split("@", 1)[0]
        original = paths["allocations"].read_text() if "allocations" in paths else None
        schedule = load_kernel(
            paths["bundles"],
            paths.get("utilization"),
            paths.get("analysis"),
            name=name,
            counter_grid=parse_grid(original, operands.get(name)) if original else None,
            operands=operands.get(name),
            mxu_rows_per_cycle=mxu_rows_per_cycle,
        )
        if original:
            schedule = dataclasses.replace(schedule, vmem_bytes=parse_vmem_bytes(original))
        if "critical_path" in paths:
            blocks = critical_path.parse_critical_path(paths["critical_path"].read_text())
            schedule = dataclasses.replace(schedule, critical_path=blocks)
        twins = [k for k in files if k != key and k.split("@", 1)[0] == name]
        if twins:
            note = f"op name {name!r} was dumped by several programs: {', '.join([key, *twins])}"
            schedule = dataclasses.replace(schedule, warnings=(*schedule.warnings, note))
        out[key] = schedule
    return out


def is_pallas_kernel(schedule: KernelSchedule) -> bool:
    """Whether the op is a Mosaic (Pallas) kernel.

    Uses the op's HLO instruction: ``custom_call_target="tpu_custom_call"`` in the schedule
    analysis file when it was loaded; otherwise the entry/exit bundle comment
    (``/* exit bundle: %flash_attention.1 = custom-call(...) */``) naming a custom-call: in the
    dumps seen, other custom-calls (``ConcatBitcast``) get no LLO program of their own.
    """
    if schedule.custom_call_target is not None:
        return schedule.custom_call_target == "tpu_custom_call"
    return schedule.hlo_opcode == "custom-call"
