"""A kernel's bundle listing: its loops and predicated regions, and how often each bundle runs.

`parse_bundles` reads a ``...-final_bundles.txt`` text (its bundles: `read.bundles`)
into a `BundleListing`.

Control flow is ``sbr.rel (%p) target = $regionN`` (or ``(!%p)``: taken when ``%p`` is false),
followed by :data:`BRANCH_DELAY_SLOTS` bundles that always execute. Region ``N`` starts at the
bundle whose trailing comment says ``Start region N`` (or ``Start/End empty region N``). A
*backward* branch to an ``LB:`` bundle closes a loop, whose body runs from the ``LB`` bundle to
the branch's last delay slot. A *forward* branch skips the bundles from after its delay slots up
to the target (marked ``PF:``): a predicated :class:`Region`.

A Pallas kernel's grid is one software-pipelined loop. Its trip count is the number of grid steps
plus the pipeline's fill and drain iterations (``1026`` for a ``(1, 16, 8, 8)`` grid): the body
keeps the step's compute in a region guarded by the loop counter (skipped in the first and last
iteration, which only start input DMAs or wait for output DMAs). :attr:`Region.guard` marks such
regions and :attr:`Loop.predicated_bundles` looks through them.

Where a region's branch predicate is a function of the loop counter and of the grid indices (the
``sphi`` registers annotated ``iteration index, stage = S iter bound = D``: grid index ``D`` of
the step that pipeline stage ``S`` works on), it is evaluated for every iteration:
:attr:`Region.executed_iterations` and :attr:`Loop.executed_bundles` are then decided (e.g. the
accumulator init and write-back of flash attention, and its causal block skip); so are the
pipeline's buffer-slot counters its DMA predicates compare. Predicates that read memory (splash
attention's block masks) stay undecided: those regions count as executed in
``executed_bundles_max`` and skipped in ``executed_bundles_min``. Each loop keeps its evaluation
(:attr:`Loop.context`) for other per-bundle figures, given as `prefix_sums`, to be weighed the
same way (`cost.llo.executed_weight`).

No JAX import: this module only reads text.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from pallas_flash_estimate.evaluate.bundle_weights import covered, mxu_prefixes
from pallas_flash_estimate.evaluate.scalar_defs import Defs, trip_count
from pallas_flash_estimate.evaluate.scalar_flow import LoopContext, LoopEval, evaluate_loop
from pallas_flash_estimate.read.bundles import Bundle, scan_bundles

__all__ = [
    "BRANCH_DELAY_SLOTS",
    "BundleListing",
    "Loop",
    "Region",
    "executed_in_loop",
    "hlo_opcode",
    "parse_bundles",
]

#: Bundles after an ``sbr.rel`` that execute whether or not the branch is taken (on v5e every
#: branch is followed by 4 bundles before the next region or loop boundary).
BRANCH_DELAY_SLOTS = 4

#: A region whose predicate depends on the loop counter only and that is skipped in at most this
#: fraction of the iterations is a pipeline guard (executed in the steady state).
_GUARD_MAX_SKIP_FRACTION = 0.5
#: Do not evaluate predicates over loops with more iterations than this.
_MAX_EVALUATED_TRIPS = 1 << 22

_REGION_START_RE = re.compile(r"Start(?:/End empty)? region (\d+)")
_STAGE_RE = re.compile(r"iteration index, stage = (\d+)")
_ITER_BOUNDS_RE = re.compile(r"iteration_bounds:\s*\(([\d,\s]*)\)")
_HLO_COMMENT_RE = re.compile(r"/\*\s*(?:exit|entry) bundle:\s*(?P<hlo>.*?)\s*\*/", re.S)
_HLO_OPCODE_RE = re.compile(r"=\s*(?:\S.*?\s)?(?P<opcode>[a-z][\w\-]*)\(")


@dataclasses.dataclass(frozen=True)
class Region:
    """A predicated region: the bundles skipped when a forward branch is taken."""

    branch: int  # bundle index of the sbr.rel
    start: int  # first skippable bundle (after the branch's delay slots)
    end: int  # last skippable bundle (inclusive); the next bundle is the PF target
    predicate: str  # "%p7" or "!%p7": the branch is taken (region skipped) when it is true
    level: int  # 0 for an outermost region, 1 for one nested in another, ...
    guard: bool = False  # pipeline guard: depends on the loop counter only, rarely skipped
    executed_iterations: int | None = None  # iterations of its loop that run it, when decidable

    @property
    def bundles(self) -> int:
        return self.end - self.start + 1


@dataclasses.dataclass(frozen=True)
class Loop:
    """One loop in a kernel's schedule."""

    start: int  # bundle index of the LB bundle
    end: int  # index of the last bundle of the body (inclusive: the back-edge's last delay slot)
    depth: int  # 1 for an outermost loop
    trip_count: int | None  # executions of the body, from its exit test; None if not constant
    predicated_bundles: int  # bundles in skippable regions: outermost ones, guards looked through
    branch: int = -1  # bundle index of the back-edge sbr.rel
    guarded_bundles: int = 0  # bundles in outermost pipeline-guard regions (Region.guard)
    regions: tuple[Region, ...] = ()  # every predicated region inside the body
    # Bundles executed over all trip_count iterations (inner loops counted once), regions
    # undecided from the schedule taken as skipped (min) or executed (max); None when the trip
    # count is unknown or the body holds inner loops.
    executed_bundles_min: int | None = None
    executed_bundles_max: int | None = None
    # Likewise, the cycles the busiest MXU is kept busy by the vmatmuls executed (see
    # bundle_weights.mxu_cycles).
    executed_mxu_cycles_min: int | None = None
    executed_mxu_cycles_max: int | None = None
    # How its regions were evaluated, to weigh other per-bundle figures the same way (see
    # llo.executed_weight); None where executed_bundles_min is.
    context: LoopContext | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def bundles(self) -> int:
        return self.end - self.start + 1

    @property
    def executed_bundles(self) -> int | None:
        """Bundles executed over all iterations, when every region was decided."""
        lo, hi = self.executed_bundles_min, self.executed_bundles_max
        return lo if lo is not None and lo == hi else None


@dataclasses.dataclass(frozen=True)
class BundleListing:
    """A parsed final_bundles file."""

    name: str
    bundles: tuple[Bundle, ...]
    loops: tuple[Loop, ...]
    regions: tuple[Region, ...]  # every predicated region, in loops or not
    grid: tuple[int, ...] | None  # DMA descriptors' largest iteration_bounds, else the counters'
    hlo: str | None  # the HLO instruction named by the entry/exit bundle comment
    warnings: tuple[str, ...]
    mxu_prefixes: dict[str, list[int]] = dataclasses.field(default_factory=dict, repr=False)
    # per MXU unit, prefix sums of the cycles its vmatmuls keep it busy (see _mxu_prefixes)

    @property
    def hlo_opcode(self) -> str | None:
        return hlo_opcode(self.hlo)


def hlo_opcode(hlo: str | None) -> str | None:
    """The opcode of an HLO instruction's text (``custom-call``, ``fusion``, ...), if any."""
    if not hlo:
        return None
    m = _HLO_OPCODE_RE.search(hlo)
    return m["opcode"] if m else None


def _region_starts(bundles: tuple[Bundle, ...]) -> dict[int, int]:
    starts: dict[int, int] = {}
    for b in bundles:
        for r in _REGION_START_RE.findall(b.comment):
            starts.setdefault(int(r), b.index)
    return starts


def _grid(text: str) -> tuple[int, ...] | None:
    grids = [
        tuple(int(x) for x in m.group(1).replace(" ", "").split(",") if x)
        for m in _ITER_BOUNDS_RE.finditer(text)
    ]
    return max(grids, key=math.prod) if grids else None


DYNAMIC_DIM = 2**31 - 1
"""A grid dimension sized at run time, as the DMA descriptors' ``iteration_bounds`` print it
(the placeholder jax's Pallas lowering gives a dynamic grid dimension)."""


def _sized_grid(
    dma_grid: tuple[int, ...] | None,
    counter_grid: tuple[int, ...] | None,
    grid_trip: int | None,
    stages: int,
) -> tuple[int, ...] | None:
    """The grid: the DMA descriptors' where it has no dimension sized at run time
    (`DYNAMIC_DIM`), else the index counters' (`read.dump_files.parse_grid`, its sizes read
    from the kernel's operands where they are constants); else, for one dimension sized at
    run time, what the grid loop's trip count leaves it after the pipeline's fill/drain
    iterations (``stages``: the deepest pipeline stage); else None (unknown)."""
    if dma_grid is None or DYNAMIC_DIM not in dma_grid:
        return dma_grid or counter_grid
    if counter_grid is not None or dma_grid.count(DYNAMIC_DIM) != 1 or grid_trip is None:
        return counter_grid
    steps, rest = divmod(grid_trip - stages, math.prod(d for d in dma_grid if d != DYNAMIC_DIM))
    if steps <= 0 or rest:
        return None
    return tuple(steps if d == DYNAMIC_DIM else d for d in dma_grid)


def parse_bundles(
    text: str,
    name: str,
    *,
    counter_grid: tuple[int, ...] | None = None,
    operands: Mapping[int, int | tuple[int, ...]] | None = None,
    mxu_rows_per_cycle: int = 1,
) -> BundleListing:
    """Parse a ``final_bundles`` text into bundles, loops and predicated regions.

    The grid is the DMA descriptors' largest ``iteration_bounds``; ``counter_grid`` (the grid
    read from the kernel's index counters, `read.dump_files.parse_grid`) stands in
    for it when the kernel has no DMA descriptor or a grid sized at run time
    (`_sized_grid`). ``operands``: the values of the kernel's integer constant operands
    (operand index -> an int or an array's elements) where known, for the loops that run to
    them and the tables they read (`Defs`). ``mxu_rows_per_cycle``: the target's MXU rate
    (`bundle_weights.mxu_cycles`).
    """
    warnings: list[str] = []
    bundles = scan_bundles(text)
    if any(b.address != b.index for b in bundles):
        warnings.append("bundle addresses are not consecutive; indices are used")
    starts = _region_starts(bundles)
    defs = Defs(bundles, operands)
    last = len(bundles) - 1

    back_edges: list[tuple[int, int, str]] = []  # (LB index, branch index, predicate)
    forward: list[tuple[int, int, str]] = []  # (branch index, target index, predicate)
    for b in bundles:
        br = b.branch()
        if br is None:
            continue
        pred, region = br
        target = starts.get(region)
        if target is None:
            warnings.append(f"bundle {b.index}: branch target $region{region} not found")
        elif target <= b.index:
            if "LB" not in bundles[target].markers:
                warnings.append(f"bundle {b.index}: backward branch to a bundle not marked LB")
            back_edges.append((target, b.index, pred))
        elif target - 1 < b.index + 1 + BRANCH_DELAY_SLOTS:
            warnings.append(f"bundle {b.index}: branch lands within its delay slots")
        else:
            forward.append((b.index, target, pred))
    lbs = sorted(b.index for b in bundles if "LB" in b.markers)
    if lbs != sorted(lb for lb, _, _ in back_edges):
        warnings.append(f"LB bundles {lbs} do not match the loop back-edges")

    # Loops (start, end, branch, predicate) and their nesting.
    spans = sorted((lb, min(br + BRANCH_DELAY_SLOTS, last), br, p) for lb, br, p in back_edges)
    depths = [
        1 + sum(1 for j, (s2, e2, *_) in enumerate(spans) if j != i and s2 <= s <= e <= e2)
        for i, (s, e, *_) in enumerate(spans)
    ]
    for (s, *_), depth in zip(spans, depths, strict=True):
        if bundles[s].nest and bundles[s].nest != depth:
            warnings.append(f"loop at {s}: {bundles[s].nest} '>' but nesting depth {depth}")
    defs.link_fills(
        bundles,
        [(s, e) for s, e, *_ in spans],
        [(br + 1 + BRANCH_DELAY_SLOTS, tgt - 1) for br, tgt, _ in forward],
    )
    trips = [trip_count(defs, p) for *_, p in spans]
    outer = [i for i, depth in enumerate(depths) if depth == 1]
    grid_loop = max(outer, key=lambda i: (spans[i][1] - spans[i][0], -spans[i][0]), default=None)
    stages = max((int(n) for n in _STAGE_RE.findall(text)), default=0)
    grid = _sized_grid(
        _grid(text), counter_grid, trips[grid_loop][0] if grid_loop is not None else None, stages
    )
    mxu = mxu_prefixes(bundles, mxu_rows_per_cycle)

    # Predicated regions, their nesting level and enclosing (innermost) loop.
    raw = sorted(
        ((br + 1 + BRANCH_DELAY_SLOTS, tgt - 1, br, p) for br, tgt, p in forward),
        key=lambda r: (r[0], -r[1]),  # enclosing regions first
    )
    levels = []
    for i, (s, e, *_) in enumerate(raw):
        level = 0
        for s2, e2, *_ in raw[:i]:
            if s2 <= s and e <= e2:
                level += 1
            elif s2 <= s <= e2 < e:
                warnings.append(f"regions {s2}-{e2} and {s}-{e} overlap without nesting")
        levels.append(level)
    owner: list[int | None] = []
    for _s, _e, br, _p in raw:
        inner = [i for i, (ls, le, *_) in enumerate(spans) if ls <= br <= le]
        owner.append(max(inner, key=lambda i: spans[i][0]) if inner else None)

    # Evaluate the region predicates over the iterations of their (innermost) loop.
    guards = [False] * len(raw)
    executed: list[int | None] = [None] * len(raw)
    evals: dict[int, LoopContext] = {}
    for li, (trip, ctr) in enumerate(trips):
        if trip is None or ctr is None or trip > _MAX_EVALUATED_TRIPS:
            continue
        mine = [i for i in range(len(raw)) if owner[i] == li]
        parents = [
            [
                k
                for k, j in enumerate(mine)
                if j != i and raw[j][0] <= raw[i][0] <= raw[i][1] <= raw[j][1]
            ]
            for i in mine
        ]
        # Grid indices are trusted when the DMA iteration bounds fit the loop: the grid steps
        # plus the pipeline's fill/drain iterations (2 in every dump seen).
        fits = grid is not None and math.prod(grid) <= trip <= math.prod(grid) + 3
        preds = [raw[i][3] for i in mine]
        result = evaluate_loop(defs, ctr, trip, grid if fits else None, preds, parents)
        evals[li] = LoopContext(
            defs, ctr, trip, grid if fits else None, [raw[i][:2] for i in mine], preds, result
        )
        for k, i in enumerate(mine):
            executed[i] = result.executed[k]
            n_skipped = result.skipped[k]
            guards[i] = (
                result.counter_only[k]
                and n_skipped is not None
                and n_skipped <= _GUARD_MAX_SKIP_FRACTION * trip
            )

    regions = [
        Region(
            branch=br,
            start=s,
            end=e,
            predicate=p,
            level=levels[i],
            guard=guards[i],
            executed_iterations=executed[i],
        )
        for i, (s, e, br, p) in enumerate(raw)
    ]

    loops = []
    for li, ((ls, le, br, _p), depth) in enumerate(zip(spans, depths, strict=True)):
        inside = [i for i in range(len(raw)) if ls <= raw[i][2] <= le]
        plain = [(raw[i][0], raw[i][1]) for i in inside if not guards[i]]
        guarded = [(raw[i][0], raw[i][1]) for i in inside if guards[i]]
        has_inner = any(j != li and ls <= s2 <= le for j, (s2, *_) in enumerate(spans))
        lo = hi = mxu_lo = mxu_hi = context = None
        if li in evals and not has_inner:
            context = evals[li]
            lo, hi = executed_in_loop((ls, le), context.spans, context.result)
            busy = [
                executed_in_loop((ls, le), context.spans, context.result, p) for p in mxu.values()
            ]
            mxu_lo = max((b[0] for b in busy), default=0)
            mxu_hi = max((b[1] for b in busy), default=0)
        loops.append(
            Loop(
                start=ls,
                end=le,
                depth=depth,
                trip_count=trips[li][0],
                predicated_bundles=covered(plain),
                branch=br,
                guarded_bundles=covered(guarded),
                regions=tuple(regions[i] for i in inside),
                executed_bundles_min=lo,
                executed_bundles_max=hi,
                executed_mxu_cycles_min=mxu_lo,
                executed_mxu_cycles_max=mxu_hi,
                context=context,
            )
        )

    hlo = None
    for b in reversed(bundles):
        m = _HLO_COMMENT_RE.search(b.comment)
        if m:
            hlo = m["hlo"]
            break
    return BundleListing(
        name=name,
        bundles=bundles,
        loops=tuple(loops),
        regions=tuple(regions),
        grid=grid,
        hlo=hlo,
        warnings=tuple(warnings),
        mxu_prefixes=mxu,
    )


def executed_in_loop(
    body: tuple[int, int],
    spans: list[tuple[int, int]],
    result: LoopEval,
    prefix: list[int] | None = None,
) -> tuple[int, int]:
    """(min, max) bundles executed over all iterations of a loop without inner loops (its
    ``body`` spans bundles ``start..end``), or with ``prefix`` (see `covered`) their weight."""
    decided = [span for span, k in zip(spans, result.skipped, strict=True) if k is not None]
    undecided = [span for span, k in zip(spans, result.skipped, strict=True) if k is None]
    whole = covered([body], prefix)
    lo = hi = 0
    for pattern, n in result.patterns.items():
        skipped = [span for span, k in zip(decided, pattern, strict=True) if k]
        hi += n * (whole - covered(skipped, prefix))
        lo += n * (whole - covered(skipped + undecided, prefix))
    return lo, hi
