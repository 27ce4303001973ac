"""Parse libtpu LLO dumps: the static VLIW schedule of each compiled HLO op ("kernel").

Compiling a JAX program for TPU with ``LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR`` makes libtpu write,
per compiled HLO op, ``<fingerprint>-<op name>-<NN>-<stage>.txt`` files. Three of them matter:

``...-final_bundles.txt``
    The scheduled program, one VLIW bundle per line::

        0x10 LB: > { %a = sst [smem:[#allocation15_spill]] %s13  ;;  %b = sadd.s32 1, %s24 }

    The address is decimal (``0``) or hex (``0x10``) and counts bundles. An optional marker
    (``LB`` loop body, ``PF`` predicated-region fallthrough; the key also lists ``LH``, ``LE``,
    ``PB``, ``CT``) comes before the colon. The ``>`` characters give the loop nesting of the
    bundle, **but only on bundles with non-control work**: empty bundles (``{}``) and the bundle
    holding a loop's back-edge branch print no ``>`` even inside a loop, so loop extents come from
    the branches. Instructions are separated by ``;;``; comments (``/* .. */``) may span lines
    (DMA descriptors with ``iteration_bounds: (1, 16, 8, 8)``): continuation lines are no bundles.

    Control flow is ``sbr.rel (%p) target = $regionN`` (or ``(!%p)``: taken when ``%p`` is
    false), followed by :data:`BRANCH_DELAY_SLOTS` bundles that always execute. Region ``N``
    starts at the bundle whose trailing comment says ``Start region N`` (or ``Start/End empty
    region N``). A *backward* branch to an ``LB:`` bundle closes a loop, whose body runs from the
    ``LB`` bundle to the branch's last delay slot. A *forward* branch skips the bundles from
    after its delay slots up to the target (marked ``PF:``): a predicated :class:`Region`.

``...-final_hlo-static-per-bundle-utilization.txt``
    ``== CAPACTIY:`` (sic), a line of unit names, a line of slot capacities, ``== UTILIZATION:``
    and one row of used slots per bundle, in bundle order.

``...-schedule-analysis_final_bundles.txt``
    ``total scheduled bundles: N`` and the op's HLO instruction (for a Pallas kernel a
    ``custom-call`` with ``custom_call_target="tpu_custom_call"``).

Two more are read when present: ``...-original.txt`` (the memory allocations, for the VMEM a
kernel uses) and ``...-critical-path.txt`` (see `pallas_flash_bench.critical_path`).

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
pipeline's buffer-slot counters its DMA predicates compare. Any other per-bundle figure is
weighed the same way by :func:`executed_weight` (the busiest MXU's cycles, the critical path
of `pallas_flash_bench.critical_path`), an instruction's executions counted by
:func:`executed_instruction` (the DMAs of `pallas_flash_bench.dma`). Predicates that
read memory (splash attention's block masks) stay undecided: those regions count as executed in
``executed_bundles_max`` and skipped in ``executed_bundles_min``.

No JAX import: this module only reads text.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from pallas_flash_bench import critical_path
from pallas_flash_bench.scalar_flow import (
    CMOV_RE,
    Defs,
    LoopContext,
    LoopEval,
    evaluate_loop,
    trip_count,
)

__all__ = [
    "BRANCH_DELAY_SLOTS",
    "Bundle",
    "BundleListing",
    "Instruction",
    "KernelSchedule",
    "Loop",
    "Region",
    "ScheduleAnalysis",
    "Utilization",
    "build_schedule",
    "executed_instruction",
    "executed_weight",
    "find_dump_files",
    "is_pallas_kernel",
    "load_dump",
    "load_kernel",
    "parse_bundles",
    "parse_schedule_analysis",
    "parse_utilization",
    "prefix_sums",
    "unit_prefixes",
]

#: Bundles after an ``sbr.rel`` that execute whether or not the branch is taken (on v5e every
#: branch is followed by 4 bundles before the next region or loop boundary).
BRANCH_DELAY_SLOTS = 4

#: A region whose predicate depends on the loop counter only and that is skipped in at most this
#: fraction of the iterations is a pipeline guard (executed in the steady state).
_GUARD_MAX_SKIP_FRACTION = 0.5
#: Do not evaluate predicates over loops with more iterations than this.
_MAX_EVALUATED_TRIPS = 1 << 22

_WRAPPER_OPS = ("TLP",)

_BUNDLE_RE = re.compile(
    r"^\s*(?P<addr>0x[0-9a-fA-F]+|\d+)\s+(?P<markers>(?:[A-Z]{2}\s*)*):\s*(?P<nest>>*)\s*\{"
)
_INSTR_RE = re.compile(r"^(?P<dest>%[\w.\-]+)\s*=\s*(?P<opcode>[A-Za-z_][\w.\-]*)\s*(?P<args>.*)$")
_GUARD_RE = re.compile(r"^\(\s*(?P<guard>!?%p\w+)\s*\)\s*,?\s*(?P<rest>.*)$", re.S)
_BRANCH_RE = re.compile(r"^\(\s*(?P<pred>!?%p\w+)\s*\)\s*target\s*=\s*\$region(?P<region>\d+)")
_REGION_START_RE = re.compile(r"Start(?:/End empty)? region (\d+)")
_ITER_BOUNDS_RE = re.compile(r"iteration_bounds:\s*\(([\d,\s]*)\)")
_HLO_COMMENT_RE = re.compile(r"/\*\s*(?:exit|entry) bundle:\s*(?P<hlo>.*?)\s*\*/", re.S)
_HLO_OPCODE_RE = re.compile(r"=\s*(?:\S.*?\s)?(?P<opcode>[a-z][\w\-]*)\(")
_CC_TARGET_RE = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_SPILL_RE = re.compile(r"\[(?:vmem|smem):\[#allocation\d+_spill")
_FILE_RE = re.compile(r"^(?P<fp>\d+)-(?P<name>.+)-(?P<nn>\d+)-(?P<kind>[\w\-]+)\.txt$")

_KIND_BUNDLES = "final_bundles"
_KIND_UTIL = "final_hlo-static-per-bundle-utilization"
_KIND_ANALYSIS = "schedule-analysis_final_bundles"
_KIND_ORIGINAL = "original"  # the first LLO pass: lists the kernel's memory allocations
_KIND_CRITICAL_PATH = "critical-path"

_VMEM_ALLOCATION_RE = re.compile(r"#allocation\d+ \[.*?space=vmem, size = 0x([0-9a-f]+)")


# --------------------------------------------------------------------------------------------
# Bundles


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a bundle."""

    dest: str | None  # "%s22_s24"; None when the text has no "%x = " prefix
    opcode: str  # full mnemonic, e.g. "vmatmul.bf16.gmra.mxu0"
    args: str  # operands after the mnemonic, comments and predicate guard removed
    guard: str | None = None  # "%p3" / "!%p3" when the instruction is predicated
    note: str = ""  # its comments, e.g. "phi copy :: iteration index, stage = 1"

    @property
    def base(self) -> str:
        """Mnemonic without its suffixes: ``vmatmul``, ``vpop``, ``dma``."""
        return self.opcode.split(".", 1)[0]


@dataclasses.dataclass(frozen=True)
class Bundle:
    index: int  # position in the listing (0-based)
    address: int  # the printed address (equal to index in every dump seen)
    markers: tuple[str, ...]  # ("LB",), ("PF",), ...
    nest: int  # number of '>' (0 on empty and back-edge bundles even in loops, see module doc)
    instructions: tuple[Instruction, ...]
    comment: str  # trailing comment(s) after the closing brace
    text: str  # raw text, continuation lines included

    @property
    def empty(self) -> bool:
        return not self.instructions

    def branch(self) -> tuple[str, int] | None:
        """``(predicate, region number)`` of the bundle's ``sbr.rel``, if any."""
        for ins in self.instructions:
            if ins.base == "sbr":
                m = _BRANCH_RE.match(ins.args)
                if m:
                    return m["pred"], int(m["region"])
        return None


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
    # MXU_ROWS_PER_CYCLE).
    executed_mxu_cycles_min: int | None = None
    executed_mxu_cycles_max: int | None = None
    # How its regions were evaluated, to weigh other per-bundle figures the same way (see
    # executed_weight); None where executed_bundles_min is.
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
    grid: tuple[int, ...] | None  # largest-product iteration_bounds of the DMA descriptors
    hlo: str | None  # the HLO instruction named by the entry/exit bundle comment
    warnings: tuple[str, ...]
    mxu_prefixes: dict[str, list[int]] = dataclasses.field(default_factory=dict, repr=False)
    # per MXU unit, prefix sums of the cycles its vmatmuls keep it busy (see _mxu_prefixes)

    @property
    def hlo_opcode(self) -> str | None:
        return _hlo_opcode(self.hlo)


def _scan_body(text: str, open_at: int) -> tuple[list[tuple[str, str]], str]:
    """Instructions (code, comments) of the bundle whose ``{`` is at ``open_at``, and the rest."""
    parts: list[tuple[str, str]] = []
    code: list[str] = []
    notes: list[str] = []
    depth = 0
    i, n = open_at, len(text)
    while i < n:
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j
            notes.append(" ".join(text[i + 2 : j].split()))
            i = j + 2
            continue
        if depth == 1 and text.startswith(";;", i):
            parts.append(("".join(code), " :: ".join(notes)))
            code, notes = [], []
            i += 2
            continue
        c = text[i]
        if c == "{":
            depth += 1
            if depth == 1:
                i += 1
                continue
        elif c == "}":
            depth -= 1
            if depth == 0:
                parts.append(("".join(code), " :: ".join(notes)))
                return parts, text[i + 1 :]
        code.append(c)
        i += 1
    parts.append(("".join(code), " :: ".join(notes)))
    return parts, ""


def _parse_instruction(code: str, note: str) -> Instruction | None:
    code = " ".join(code.split())
    if not code:
        return None
    m = _INSTR_RE.match(code)
    if m:
        dest, opcode, args = m["dest"], m["opcode"], m["args"]
    else:
        dest = None
        opcode, _, args = code.partition(" ")
    guard = None
    g = _GUARD_RE.match(args)
    if g and not opcode.startswith("sbr") and not CMOV_RE.match(args):
        guard, args = g["guard"], g["rest"]  # for a branch the predicate is its condition
    return Instruction(dest=dest, opcode=opcode, args=args.strip(), guard=guard, note=note)


def _make_bundle(index: int, lines: list[str]) -> Bundle:
    text = "\n".join(lines)
    m = _BUNDLE_RE.match(text)
    assert m is not None
    parts, trailing = _scan_body(text, m.end() - 1)
    instrs = [ins for code, note in parts if (ins := _parse_instruction(code, note)) is not None]
    return Bundle(
        index=index,
        address=int(m["addr"], 0),
        markers=tuple(m["markers"].split()),
        nest=len(m["nest"]),
        instructions=tuple(instrs),
        comment=" ".join(trailing.split()),
        text=text,
    )


def _split_records(text: str) -> list[list[str]]:
    records: list[list[str]] = []
    for line in text.splitlines():
        if _BUNDLE_RE.match(line):
            records.append([line])
        elif records:
            records[-1].append(line)  # continuation of a multi-line comment
    return records


def _hlo_opcode(hlo: str | None) -> str | None:
    if not hlo:
        return None
    m = _HLO_OPCODE_RE.search(hlo)
    return m["opcode"] if m else None


# --------------------------------------------------------------------------------------------
# Listing


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


def _covered(spans: Iterable[tuple[int, int]], prefix: list[int] | None = None) -> int:
    """Bundles covered by a union of inclusive spans, or with ``prefix`` (``prefix[i]``: the
    summed weight of bundles ``0..i-1``) their summed weight."""
    total, reach = 0, -1
    for s, e in sorted(spans):
        if e <= reach:
            continue
        first = max(s, reach + 1)
        total += e - first + 1 if prefix is None else prefix[e + 1] - prefix[first]
        reach = e
    return total


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


MXU_ROWS_PER_CYCLE = 1
"""Rows of the left operand one MXU takes per cycle (128 x 128 multiply-adds): a ``vmatmul``
of a bfloat16 vreg (16 packed rows) keeps its MXU busy 16 cycles, of a float32 vreg 8. This is
what 197 TFLOP/s at 1.5 GHz over 4 MXUs of 128 x 128 implies."""


def unit_prefixes(
    bundles: tuple[Bundle, ...], family: str, cycles: Callable[[Instruction], int]
) -> dict[str, list[int]]:
    """Per MXU (``mxu0``..): prefix sums over the bundles of ``cycles`` of its instructions of
    the ``family`` (``vmatmul``, ``vmatpush``: every mnemonic starting so), the unit read from
    the mnemonic's last suffix."""
    units: dict[str, list[int]] = {}
    for b in bundles:
        for ins in b.instructions:
            if ins.base.startswith(family):
                unit = ins.opcode.rsplit(".", 1)[-1]
                units.setdefault(unit, [0] * len(bundles))[b.index] += cycles(ins)
    return {unit: prefix_sums(weights) for unit, weights in units.items()}


def prefix_sums(weights: Sequence[int]) -> list[int]:
    """``[0, w0, w0 + w1, ...]``: the form `executed_weight` takes per-bundle weights in."""
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    return prefix


def _mxu_prefixes(bundles: tuple[Bundle, ...]) -> dict[str, list[int]]:
    """Per MXU: prefix sums of the cycles its ``vmatmul``s keep it busy."""
    return unit_prefixes(
        bundles, "vmatmul", lambda ins: (16 if ".bf16" in ins.opcode else 8) // MXU_ROWS_PER_CYCLE
    )


def parse_bundles(text: str, name: str) -> BundleListing:
    """Parse a ``final_bundles`` text into bundles, loops and predicated regions."""
    warnings: list[str] = []
    bundles = tuple(_make_bundle(i, rec) for i, rec in enumerate(_split_records(text)))
    if any(b.address != b.index for b in bundles):
        warnings.append("bundle addresses are not consecutive; indices are used")
    starts = _region_starts(bundles)
    defs = Defs(bundles)
    grid = _grid(text)
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
    trips = [trip_count(defs, p) for *_, p in spans]
    mxu = _mxu_prefixes(bundles)

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
            lo, hi = _executed_bundles((ls, le), context.spans, context.result)
            busy = [
                _executed_bundles((ls, le), context.spans, context.result, p) for p in mxu.values()
            ]
            mxu_lo = max((b[0] for b in busy), default=0)
            mxu_hi = max((b[1] for b in busy), default=0)
        loops.append(
            Loop(
                start=ls,
                end=le,
                depth=depth,
                trip_count=trips[li][0],
                predicated_bundles=_covered(plain),
                branch=br,
                guarded_bundles=_covered(guarded),
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


def _executed_bundles(
    body: tuple[int, int],
    spans: list[tuple[int, int]],
    result: LoopEval,
    prefix: list[int] | None = None,
) -> tuple[int, int]:
    """(min, max) bundles executed over all iterations of a loop without inner loops (its
    ``body`` spans bundles ``start..end``), or with ``prefix`` (see `_covered`) their weight."""
    decided = [span for span, k in zip(spans, result.skipped, strict=True) if k is not None]
    undecided = [span for span, k in zip(spans, result.skipped, strict=True) if k is None]
    whole = _covered([body], prefix)
    lo = hi = 0
    for pattern, n in result.patterns.items():
        skipped = [span for span, k in zip(decided, pattern, strict=True) if k]
        hi += n * (whole - _covered(skipped, prefix))
        lo += n * (whole - _covered(skipped + undecided, prefix))
    return lo, hi


# --------------------------------------------------------------------------------------------
# Utilization and schedule analysis


@dataclasses.dataclass(frozen=True)
class Utilization:
    units: tuple[str, ...]
    capacity: dict[str, int]
    rows: tuple[tuple[int, ...], ...]  # per bundle, slots used per unit (in ``units`` order)
    warnings: tuple[str, ...] = ()

    def summed(self, start: int = 0, end: int | None = None) -> dict[str, int]:
        """Slots used per unit over bundles ``start..end`` (inclusive)."""
        stop = len(self.rows) if end is None else end + 1
        sums = [0] * len(self.units)
        for row in self.rows[start:stop]:
            for k, v in enumerate(row):
                sums[k] += v
        return dict(zip(self.units, sums, strict=True))


def parse_utilization(text: str) -> Utilization:
    """Parse a ``final_hlo-static-per-bundle-utilization`` text."""
    lines = [ln.strip() for ln in text.splitlines()]
    warnings: list[str] = []
    try:
        cap_at = next(i for i, ln in enumerate(lines) if re.match(r"==\s*CAPAC\w*\s*:", ln))
        util_at = next(i for i, ln in enumerate(lines) if re.match(r"==\s*UTILIZATION\s*:", ln))
    except StopIteration:
        raise ValueError("not a per-bundle utilization file (no CAPACITY/UTILIZATION)") from None
    head = [ln for ln in lines[cap_at + 1 : util_at] if ln]
    if len(head) != 2:
        raise ValueError(f"expected unit names and capacities, got {len(head)} lines")
    units = tuple(u.strip() for u in head[0].split(",") if u.strip())
    caps = [int(x) for x in head[1].split()]
    if len(caps) != len(units):
        raise ValueError(f"{len(units)} units but {len(caps)} capacities")
    rows = []
    for i, ln in enumerate(lines[util_at + 1 :]):
        if not ln:
            continue
        vals = tuple(int(x) for x in ln.split())
        if len(vals) != len(units):
            warnings.append(f"utilization row {i} has {len(vals)} values, expected {len(units)}")
            vals = (vals + (0,) * len(units))[: len(units)]
        rows.append(vals)
    return Utilization(
        units=units,
        capacity=dict(zip(units, caps, strict=True)),
        rows=tuple(rows),
        warnings=tuple(warnings),
    )


@dataclasses.dataclass(frozen=True)
class ScheduleAnalysis:
    total: int | None  # total scheduled bundles
    empty: int | None  # empty scheduled bundles
    hlo: str | None  # the first HLO instruction attributed bundles

    @property
    def custom_call_target(self) -> str | None:
        m = _CC_TARGET_RE.search(self.hlo or "")
        return m["target"] if m else None


def parse_schedule_analysis(text: str) -> ScheduleAnalysis:
    def num(label: str) -> int | None:
        m = re.search(rf"^\s*{label}:\s*(\d+)", text, re.M)
        return int(m.group(1)) if m else None

    m = re.search(r"scheduled bundles \([^)]*\):\s*(%.*)", text)
    hlo = None
    if m:
        # The instruction may span lines (frontend attributes with embedded newlines); stop at
        # the per-opcode summary.
        rest = text[m.start(1) :]
        hlo = rest.split("\n\t[opcode]")[0].strip()
    return ScheduleAnalysis(
        total=num("total scheduled bundles"), empty=num("empty scheduled bundles"), hlo=hlo
    )


# --------------------------------------------------------------------------------------------
# Kernel schedule


@dataclasses.dataclass(frozen=True)
class KernelSchedule:
    name: str  # op name from the file name, e.g. "flash_attention.1"
    bundles: int  # total bundles
    loops: tuple[Loop, ...]
    grid: tuple[int, ...] | None  # largest-product iteration_bounds of the DMA descriptors
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
    # MXU_ROWS_PER_CYCLE): when above the executed bundles the kernel is MXU-bound and the
    # bundle count underestimates its time.
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
    skippable = _covered(
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
        hlo_opcode=_hlo_opcode(hlo) or listing.hlo_opcode,
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
    `prefix_sums`), weighed like the executed bundles: straight-line code once,
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
    straight = [(_covered(outer_spans, p), _covered(outer_regions, p)) for p in prefixes]
    lo = max((a - b for a, b in straight), default=0)
    hi = max((a for a, _ in straight), default=0)
    for lp in top:
        ctx = lp.context
        assert ctx is not None
        busy = [_executed_bundles((lp.start, lp.end), ctx.spans, ctx.result, p) for p in prefixes]
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


def _read(path: str | Path, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"LLO dump {what} file not found: {p}")
    return p.read_text(encoding="utf-8", errors="replace")


def _op_name(path: Path) -> str:
    m = _FILE_RE.match(path.name)
    return m["name"] if m else path.stem


def load_kernel(
    bundles_path: str | Path,
    utilization_path: str | Path | None = None,
    analysis_path: str | Path | None = None,
    *,
    name: str | None = None,
) -> KernelSchedule:
    """Load one kernel from its final_bundles file (and optional companions).

    Raises :class:`FileNotFoundError` naming the path when a given file is missing.
    """
    text = _read(bundles_path, "final_bundles")
    util = parse_utilization(_read(utilization_path, "utilization")) if utilization_path else None
    ana = (
        parse_schedule_analysis(_read(analysis_path, "schedule-analysis"))
        if analysis_path
        else None
    )
    listing = parse_bundles(text, name or _op_name(Path(bundles_path)))
    return build_schedule(listing, util, ana)


def find_dump_files(dump_dir: str | Path) -> dict[str, dict[str, Path]]:
    """Per op, keyed like :func:`load_dump`: its ``bundles``, ``utilization``, ``analysis``,
    ``allocations`` and ``critical_path`` paths (the companions when dumped).

    The wrapper programs (``<late-finalization>``, ``<late-initialization>``, ``TLP``) are left
    out. Raises :class:`FileNotFoundError` when the folder is missing or holds no final_bundles
    file at all (the dump flag did not reach libtpu).
    """
    d = Path(dump_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"LLO dump folder not found: {d}")
    kinds = {
        _KIND_BUNDLES: "bundles",
        _KIND_UTIL: "utilization",
        _KIND_ANALYSIS: "analysis",
        _KIND_ORIGINAL: "allocations",
        _KIND_CRITICAL_PATH: "critical_path",
    }
    found: dict[tuple[str, str], dict[str, tuple[int, Path]]] = {}
    any_bundles = False
    for p in sorted(d.iterdir()):
        m = _FILE_RE.match(p.name)
        if not m or m["kind"] not in kinds:
            continue
        any_bundles = any_bundles or m["kind"] == _KIND_BUNDLES
        name = m["name"]
        if name.startswith("<") or name in _WRAPPER_OPS:
            continue
        files = found.setdefault((m["fp"], name), {})
        kind, nn = kinds[m["kind"]], int(m["nn"])
        if kind not in files or files[kind][0] < nn:
            files[kind] = (nn, p)
    if not any_bundles:
        raise FileNotFoundError(f"no *-final_bundles.txt file in LLO dump folder {d}")
    out: dict[str, dict[str, Path]] = {}
    for (fp, name), files in sorted(found.items()):
        if "bundles" not in files:
            continue
        key = name if name not in out else f"{name}@{fp}"
        out[key] = {kind: path for kind, (_nn, path) in files.items()}
    return out


def parse_vmem_bytes(text: str) -> int:
    """Bytes of VMEM an LLO program allocates: the sum of its ``space=vmem`` allocations
    (scratch operands, the double-buffered block windows, internal scratch), as listed in the
    ``...-original.txt`` pass of the dump."""
    return sum(int(size, 16) for size in _VMEM_ALLOCATION_RE.findall(text))


def load_dump(dump_dir: str | Path) -> dict[str, KernelSchedule]:
    """Every op of a dump folder with a final_bundles file, keyed by op name.

    When several programs were dumped into one folder and an op name occurs in more than one,
    the first fingerprint (in sorted order) keeps the plain name, the others are keyed
    ``"<name>@<fingerprint>"``, and all of them carry a warning.
    """
    files = find_dump_files(dump_dir)
    out: dict[str, KernelSchedule] = {}
    for key, paths in files.items():
        name = key.split("@", 1)[0]
        schedule = load_kernel(
            paths["bundles"], paths.get("utilization"), paths.get("analysis"), name=name
        )
        if "allocations" in paths:
            vmem = parse_vmem_bytes(paths["allocations"].read_text())
            schedule = dataclasses.replace(schedule, vmem_bytes=vmem)
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
