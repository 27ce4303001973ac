"""How often each op of a whole program runs: the trip counts of its ``while`` loops.

A model step scans its layers: the compiled HLO holds one layer's ops inside a ``while`` body
that runs once per layer. The static schedule has one listing per op, so an op's cycles must
be counted as often as the loops around it run. The trip count comes from the HLO itself:
the ``known_trip_count`` XLA records in a loop's backend config when it has one, else the
loop's shape after XLA's passes, ``i = C; while (i < N) { ...; i = i + 1 }``: its condition
compares one tuple element with a constant bound, its init tuple starts that element at a
constant and its body adds one to it. A loop of any other shape is *undetermined*: its ops
are counted once, and the caller says so.

Branches of a ``conditional`` are counted as if taken every time (an upper bound; the model
steps have none in their hot path), unless the caller knows how often each is taken
(``branch_shares``: a context-parallel ring's pairs of chunks, skipped, diagonal or
unmasked, in shares its layout fixes): each branch then runs that share of the
conditional's runs. No JAX import: this module only reads text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from pallas_flash_estimate.read.hlo import (
    Computation,
    HloOp,
    fused_computation,
    parse_computations,
)
from pallas_flash_estimate.read.hlo_ops import BRANCHES_RE, is_collective

_CONSTANT_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*[su]\d+\[\]\S*\s+constant\((?P<value>-?\d+)\)",
    re.M,
)
_CHANNEL_RE = re.compile(r"\bchannel_id=(\d+)")
_INDEX_RE = re.compile(r"\bindex=(?P<index>\d+)")
_DIRECTION_RE = re.compile(r"\bdirection=(?P<direction>\w+)")
_LOOP_PARTS_RE = re.compile(r"\b(?P<part>condition|body)=%(?P<name>[\w.\-]+)")
_CALLED_RE = re.compile(
    r"\b(?:calls|to_apply|called_computations)=\{?(?P<names>%[\w.\-]+(?:,\s*%[\w.\-]+)*)"
)


@dataclasses.dataclass(frozen=True)
class ProgramRuns:
    """Executions of each computation and op of one run of a program.

    Attributes:
      computations: computation name -> how often it runs (ENTRY: 1; a loop body: its
        caller's count times the trip count; a fused or called computation: its caller's;
        a conditional's branch: its caller's, or that times the branch's share when
        ``shares`` has one: then a mean, not a whole number).
      trips: ``while`` op name -> its trip count (None: undetermined, counted once).
      ops: op name -> how often it runs (its computation's count).
      sequential: the computations whose ops run one after another as programs of their
        own (ENTRY, loop bodies and conditions, conditional branches), not those fused into
        or applied by an op.
      shares: ``conditional`` op name -> the share of its runs each branch takes, in branch
        order (only the conditionals given ``branch_shares``).
    """

    computations: dict[str, float]
    trips: dict[str, int | None]
    ops: dict[str, float] = dataclasses.field(default_factory=dict)
    sequential: frozenset[str] = frozenset()
    shares: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)

    def runs(self, op_name: str) -> float:
        """Executions of the op called ``op_name`` (1 for a name the program lacks)."""
        return self.ops.get(op_name, 1)

    @property
    def undetermined(self) -> list[str]:
        return sorted(name for name, trips in self.trips.items() if trips is None)


def constants(text: str) -> dict[str, int]:
    """Every integer scalar constant of the module, by instruction name (names are unique in
    an HLO module)."""
    return {m["name"]: int(m["value"]) for m in _CONSTANT_RE.finditer(text)}


def _known_trip_count(op: HloOp) -> int | None:
    match = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(?P<n>\d+)"', op.attributes)
    return int(match["n"]) if match else None


def _by_name(comp: Computation) -> dict[str, HloOp]:
    return {op.name: op for op in comp.ops}


def _through_copies(op: HloOp | None, ops: dict[str, HloOp]) -> HloOp | None:
    """The op whose value ``op`` holds, looking through copies and bitcasts."""
    while op is not None and op.opcode in ("copy", "bitcast") and op.operands:
        op = ops.get(op.operands[0])
    return op


def _counter(op: HloOp | None, ops: dict[str, HloOp]) -> int | None:
    """The tuple index ``op`` reads when it is ``get-tuple-element(parameter)`` (or a copy)."""
    op = _through_copies(op, ops)
    if op is None or op.opcode != "get-tuple-element":
        return None
    source = ops.get(op.operands[0]) if op.operands else None
    match = _INDEX_RE.search(op.attributes)
    if source is None or source.opcode != "parameter" or match is None:
        return None
    return int(match["index"])


def _value(name: str, ops: dict[str, HloOp], values: dict[str, int]) -> int | None:
    """The integer an op holds when it is a scalar constant or a copy of one."""
    op = _through_copies(ops.get(name), ops)
    return values.get(op.name if op is not None else name)


def _bound(condition: Computation, values: dict[str, int]) -> tuple[int, int] | None:
    """(counter index, exclusive bound) of a condition ``counter < N`` (or ``N > counter``)."""
    ops = _by_name(condition)
    root = condition.root
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = _DIRECTION_RE.search(root.attributes)
    lhs, rhs = (ops.get(name) for name in root.operands)
    if direction is None:
        return None
    if direction["direction"] == "LT" and rhs is not None and rhs.name in values:
        index = _counter(lhs, ops)
        return None if index is None else (index, values[rhs.name])
    if direction["direction"] == "GT" and lhs is not None and lhs.name in values:
        index = _counter(rhs, ops)
        return None if index is None else (index, values[lhs.name])
    return None


def _steps_by_one(body: Computation, index: int, values: dict[str, int]) -> bool:
    """Whether the body's result tuple sets element ``index`` to that element plus one."""
    ops = _by_name(body)
    root = body.root
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return False
    step = ops.get(root.operands[index])
    if step is None or step.opcode != "add" or len(step.operands) != 2:
        return False
    a, b = (ops.get(name) for name in step.operands)
    return any(
        _counter(counter, ops) == index and one is not None and _value(one.name, ops, values) == 1
        for counter, one in ((a, b), (b, a))
    )


def trip_count(loop: HloOp, comps: dict[str, Computation], values: dict[str, int]) -> int | None:
    """The trip count of the ``while`` op ``loop``, or None when its shape does not tell."""
    known = _known_trip_count(loop)
    if known is not None:
        return known
    parts = {m["part"]: m["name"] for m in _LOOP_PARTS_RE.finditer(loop.attributes)}
    condition, body = comps.get(parts.get("condition", "")), comps.get(parts.get("body", ""))
    caller = comps.get(loop.computation)
    if condition is None or body is None or caller is None or not loop.operands:
        return None
    bound = _bound(condition, values)
    if bound is None:
        return None
    index, end = bound
    init = _by_name(caller).get(loop.operands[0])
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    start = _value(init.operands[index], _by_name(caller), values)
    if start is None or not _steps_by_one(body, index, values):
        return None
    return max(end - start, 0)


def callees(op: HloOp) -> list[tuple[str, str]]:
    """(called computation, how: ``body``, ``condition``, ``branch`` or ``called``) of an op."""
    out: list[tuple[str, str]] = []
    if op.opcode == "while":
        parts = {m["part"]: m["name"] for m in _LOOP_PARTS_RE.finditer(op.attributes)}
        out += [(parts[p], p) for p in ("condition", "body") if p in parts]
    for match in _CALLED_RE.finditer(op.attributes):
        out += [(n.strip().lstrip("%"), "called") for n in match["names"].split(",")]
    for match in BRANCHES_RE.finditer(op.attributes):
        names = (match["names"] or match["one"]).split(",")
        out += [(n.strip().lstrip("%"), "branch") for n in names]
    return out


BranchShares = Callable[[HloOp], Sequence[float] | None]
"""A conditional op -> the share of its runs each branch takes (branch order), or None for
every branch every time."""


def branches(op: HloOp) -> list[str]:
    """The branch computations of a ``conditional`` op, in branch order (none for others)."""
    return [name for name, how in callees(op) if how == "branch"]


def program_runs(
    text: str,
    comps: dict[str, Computation] | None = None,
    branch_shares: BranchShares | None = None,
) -> ProgramRuns:
    """`ProgramRuns` of the optimised HLO ``text`` of one program (``compiled.as_text()``);
    ``comps``: its `parse_computations`, when the caller has them already; ``branch_shares``:
    how often the branches of a conditional run (module doc; raises ValueError when the
    shares given do not match its branches)."""
    comps = parse_computations(text) if comps is None else comps
    values = constants(text)
    runs: dict[str, float] = {}
    trips: dict[str, int | None] = {}
    shares: dict[str, tuple[float, ...]] = {}
    sequential = {c.name for c in comps.values() if c.entry}
    pending: list[tuple[str, float]] = [(name, 1) for name in sequential]
    while pending:
        name, count = pending.pop()
        comp = comps.get(name)
        if comp is None or runs.get(name, -1) >= count:
            continue
        runs[name] = count
        for op in comp.ops:
            if op.opcode == "while" and op.name not in trips:
                trips[op.name] = trip_count(op, comps, values)
            if op.opcode == "conditional" and branch_shares is not None:
                _record_shares(op, branch_shares, shares)
            branch = 0
            for callee, how in callees(op):
                n: float | None = trips.get(op.name) if how == "body" else 1
                if how == "branch":
                    n = shares[op.name][branch] if op.name in shares else 1
                    branch += 1
                if how != "called" and name in sequential:
                    sequential.add(callee)
                # a condition runs once more than the body; its ops are negligible
                pending.append((callee, count * (n if n is not None else 1)))
    ops = {op.name: runs.get(comp.name, 1) for comp in comps.values() for op in comp.ops}
    return ProgramRuns(runs, trips, ops, frozenset(sequential), shares)


def _record_shares(op: HloOp, branch_shares: BranchShares, shares: dict) -> None:
    given = branch_shares(op)
    if given is None:
        return
    count = len(branches(op))
    if len(given) != count:
        raise ValueError(
            f"branch_shares: expected {count} shares for {op.name}'s branches, got {given}"
        )
    shares[op.name] = tuple(given)


def enclosing_branches(comps: dict[str, Computation]) -> dict[str, tuple[str, int]]:
    """Op name -> (the innermost ``conditional`` it runs under, the index of its branch), for
    the ops that run under one (in a branch, or in a computation a branch calls)."""
    out: dict[str, tuple[str, int]] = {}
    pending: list[tuple[str, tuple[str, int] | None]] = [
        (c.name, None) for c in comps.values() if c.entry
    ]
    seen: set[str] = set()
    while pending:
        name, branch = pending.pop()
        comp = comps.get(name)
        if comp is None or name in seen:
            continue
        seen.add(name)
        for op in comp.ops:
            if branch is not None:
                out[op.name] = branch
            index = 0
            for callee, how in callees(op):
                inner = branch
                if how == "branch":
                    inner, index = (op.name, index), index + 1
                pending.append((callee, inner))
    return out


def is_async_start(op: HloOp) -> bool:
    """Whether ``op`` starts one of XLA's asynchronous collective fusions."""
    return op.name.startswith("async-collective-start")


def _channel(op: HloOp) -> str | None:
    match = _CHANNEL_RE.search(op.attributes)
    return match[1] if match else None


def collective_keys(comps: dict[str, Computation], program: ProgramRuns) -> dict[str, str]:
    """Which collective each op of the program's sequential computations takes part in, by
    op name: a collective op (synchronous, or the ``-start`` of a pair, and its ``-done``) is
    one of its own, named by the op. XLA's asynchronous collective fusions split one
    collective over an ``async-collective-start``, continuation fusions and an
    ``async-collective-done``, each fusing an op with the start's ``channel_id``: they are
    named by the start. Any other fusion holding a collective is one of its own. Ops that
    take part in none are absent. (Distinct collectives may share a channel id: shard_map's
    reductions may all carry 1.)"""
    ops = [op for name in sorted(program.sequential) if name in comps for op in comps[name].ops]
    starts: dict[str, str] = {}
    for op in filter(is_async_start, ops):
        inner = _fused_collective(op, comps)
        channel = None if inner is None else _channel(inner)
        if channel is not None:
            starts.setdefault(channel, op.name)
    keys: dict[str, str] = {}
    by_name = {op.name: op for op in ops}
    for op in ops:
        if is_collective(op):
            keys[op.name] = op.name
        elif op.opcode.endswith("-done") and op.operands and op.operands[0] in by_name:
            start = by_name[op.operands[0]]
            if is_collective(start):
                keys[op.name] = start.name  # all-gather-done(all-gather-start)
        else:
            inner = _fused_collective(op, comps)
            if inner is not None:
                keys[op.name] = starts.get(_channel(inner) or "", op.name)
    return keys


def _fused_collective(op: HloOp, comps: dict[str, Computation]) -> HloOp | None:
    """The collective op fused into ``op``, if any. An all-reduce whose result the fusion
    slices at its own partition's offset is XLA's all-reduce-scatter fusion, which runs as a
    reduce-scatter: it comes back with the opcode ``all-reduce-scatter`` (`ici` charges it
    the reduce-scatter's traffic)."""
    fused = fused_computation(op, comps)
    if fused is None:
        return None
    inner = next(filter(is_collective, fused.ops), None)
    opcodes = {o.opcode for o in fused.ops}
    if (
        inner is not None
        and inner.opcode == "all-reduce"
        and {"dynamic-slice", "partition-id"} <= opcodes
    ):
        return dataclasses.replace(inner, opcode="all-reduce-scatter")
    return inner


def collective_groups(
    comps: dict[str, Computation], program: ProgramRuns, keys: dict[str, str]
) -> dict[str, tuple[HloOp, int]]:
    """Each collective the program runs, by its key (`collective_keys`): the collective op
    (the one a fusion holds, at its first op) and how often it runs."""
    out: dict[str, tuple[HloOp, int]] = {}
    for name in sorted(program.sequential):
        for op in comps[name].ops if name in comps else ():
            key = keys.get(op.name)
            if key is None or key in out:
                continue
            inner = op if is_collective(op) else _fused_collective(op, comps)
            if inner is not None:
                out[key] = (inner, program.computations.get(name, 1))
    return out
