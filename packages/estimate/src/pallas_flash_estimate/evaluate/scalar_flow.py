"""Scalar data flow of a bundle listing: loop counters, grid indices and branch predicates.

The scalar core computes, per loop iteration, the predicates that decide which predicated
regions (and which guarded instructions, such as a pipeline's DMAs) run. `Defs` maps every
register to its defining instruction and `trip_count` reads a loop's exit test
(`scalar_defs`); `Evaluator`
computes registers and predicates for all iterations at once (NumPy arrays) from the loop
counter, the grid indices of the ``sphi`` registers annotated ``iteration index, stage = S iter
bound = D``, counters that step by an amount independent of themselves (a pipeline's
buffer slots), the kernel's constant operands and the constant tables it loads from SMEM (a
block-sparse mask's block indices: `Defs.tables`). `evaluate_loop` evaluates a loop's region
predicates; `LoopContext` keeps what it needs to evaluate more of them later (see
`llo.executed_instruction`).

No JAX import: this module only reads text.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING

import numpy as np

from pallas_flash_estimate.evaluate.scalar_defs import CMP_RE, INT_RE, Counter, Defs
from pallas_flash_estimate.read.bundles import CMOV_RE

if TYPE_CHECKING:
    from pallas_flash_estimate.read.bundles import Instruction

__all__ = ["Evaluator", "LoopContext", "LoopEval", "evaluate_loop"]

#: Evaluate in chunks of this many iterations.
_EVAL_CHUNK = 1 << 16
_MASK32 = (1 << 32) - 1
_ITER_INDEX_RE = re.compile(r"iteration index, stage = (\d+)(?: iter bound = (\d+))?")


def _signed(v: np.ndarray) -> np.ndarray:
    return np.where(v >= 1 << 31, v - (1 << 32), v)


_FILL_DRAIN = 3
"""The most iterations a Pallas pipeline runs besides its grid steps (2 in every dump seen)."""
_TABLE_LOAD_RE = re.compile(r"\[smem:\[(?P<alloc>#allocation\d+)(?: \+ (?P<index>%s\w+|\d+))?\]\]")


class Evaluator:
    """Values of scalar registers and predicates over all iterations of one loop (NumPy arrays).

    Leaves: the loop counter, the grid-index ``sphi`` registers (``iteration index, stage =
    S iter bound = D``), taken as index ``D`` of grid step ``counter - S`` in row-major order,
    and other ``sphi`` registers that start at a constant and step by an amount not depending
    on themselves (the pipeline's buffer-slot counters, `_recurrence`). Anything else (memory
    loads, unknown opcodes) is undecidable: None. So is a predicated definition, unless
    ``assume_guards``: it is then computed as if it ran every iteration and its guard joins
    :attr:`assumed`; the values are exact on the iterations where all those guards hold (the
    caller checks which, `evaluate_loop`).
    """

    def __init__(
        self,
        defs: Defs,
        counter: Counter,
        iters: np.ndarray,
        grid: tuple[int, ...] | None,
        *,
        assume_guards: bool = False,
    ):
        self.defs = defs
        self.assume_guards = assume_guards
        self.assumed: set[str] = set()  # guards of the predicated definitions used
        self.counter = counter
        self.phi = counter.phi
        self.iters = iters  # counter values to evaluate at
        self.given_grid = grid
        self.grid = grid if counter.start == 0 else None
        self.cache: dict[str, np.ndarray | None] = {}

    def _recurrence(self, name: str, ins: Instruction, depth: int) -> np.ndarray | None:
        """Values of a phi ``init, next`` with a constant ``init`` and a ``next`` that does not
        depend on the phi, or exceeds it by an amount that does not (probed with two values):
        the previous iteration's value of something, or a counter."""
        ops = self.defs.operands(ins)
        inits = [c for o in ops if (c := self.defs.constant(o)) is not None]
        nexts = [o for o in ops if self.defs.constant(o) is None]
        if len(inits) != 1 or len(nexts) != 1 or not len(self.iters):
            return None
        start = self.counter.start
        every = np.arange(start, int(self.iters[-1]) + 1, dtype=np.int64)
        afters, steps = [], []
        for probe in (0, 1 << 20):
            sub = Evaluator(
                self.defs, self.counter, every, self.given_grid, assume_guards=self.assume_guards
            )
            sub.cache[name] = np.full(every.shape, probe, dtype=np.int64)
            after = sub.value(nexts[0], depth + 1)
            if after is None or sub.assumed:  # through a guarded definition, one skipped
                return None  # run would leave a stale value for every later iteration
            afters.append(after)
            steps.append((after - probe) & _MASK32)
        if np.array_equal(afters[0], afters[1]):
            values = np.concatenate([[inits[0]], afters[0][:-1]])
        elif np.array_equal(steps[0], steps[1]):
            values = inits[0] + np.concatenate([[0], np.cumsum(steps[0])[:-1]])
        else:
            return None
        return values[self.iters - start] & _MASK32

    def _grid_index(self, stage: int, dim: int | None) -> np.ndarray | None:
        flat = self.iters - stage
        if dim is None:
            return flat & _MASK32
        if self.grid is None or dim >= len(self.grid):
            return None
        steps = math.prod(self.grid)
        flat = np.mod(flat, steps)
        inner = math.prod(self.grid[dim + 1 :])
        return (flat // inner) % self.grid[dim]

    def value(self, name: str, depth: int = 0) -> np.ndarray | None:
        """u32 values (as int64) of operand ``name`` per iteration."""
        if INT_RE.match(name):
            return np.full(self.iters.shape, int(name) & _MASK32, dtype=np.int64)
        name = self.defs.resolve(name)
        if name in self.defs.operands_known:  # a scalar operand the kernel is called with
            return np.full(self.iters.shape, self.defs.operands_known[name] & _MASK32)
        if name in self.cache:
            return self.cache[name]
        self.cache[name] = None  # cycles are undecidable
        result = self._compute(name, depth) if depth < 200 else None
        self.cache[name] = result
        return result

    def _usable(self, ins: Instruction | None) -> Instruction | None:
        """``ins`` when it can be evaluated (its guard recorded when assumed), else None."""
        if ins is None or (ins.guard is not None and not self.assume_guards):
            return None
        if ins.guard is not None:
            self.assumed.add(ins.guard)
        return ins

    def _compute(self, name: str, depth: int) -> np.ndarray | None:
        if name == self.phi:
            return self.iters & _MASK32
        ins = self._usable(self.defs.defs.get(name))
        if ins is None:
            return None
        op, ops = ins.opcode, self.defs.operands(ins)
        if op == "sphi":
            m = _ITER_INDEX_RE.search(ins.note)
            if m is None:
                return self._recurrence(name, ins, depth)
            return self._grid_index(int(m[1]), int(m[2]) if m[2] is not None else None)
        if op == "smov":
            cm = CMOV_RE.match(ins.args)
            if cm is None:
                return None  # constants and copies were resolved already
            p = self.pred(cm["pred"], depth + 1)
            old, new = self.value(cm["old"], depth + 1), self.value(cm["new"], depth + 1)
            return None if p is None or old is None or new is None else np.where(p, new, old)
        if op == "sld":  # a load from a constant table (`Defs.tables`)
            return self._table_load(ins.args, depth)
        if op == "spop.drf":  # the quotient, then the remainder, of an ``sdivrem.u32``
            return self._divrem(name, ops[0], depth)
        if op == "scalar_select" and len(ops) == 3:
            p = self.pred(ops[0], depth + 1)
            a, b = self.value(ops[1], depth + 1), self.value(ops[2], depth + 1)
            return None if p is None or a is None or b is None else np.where(p, a, b)
        m = CMP_RE.match(op)
        if m or op.startswith("p"):
            r = self.pred(name, depth + 1)
            return None if r is None else r.astype(np.int64)
        vals = [self.value(o, depth + 1) for o in ops]
        if len(vals) != 2 or vals[0] is None or vals[1] is None:
            return None
        a, b = vals
        base = op.split(".", 1)[0]
        if base == "sadd":
            r = a + b
        elif base == "ssub":
            r = a - b
        elif base == "smul":
            r = (a * b) & _MASK32
        elif base == "smulhi":  # the high word: a division by a constant that is no power of 2
            if op.endswith("s32"):
                r = (_signed(a) * _signed(b)) >> 32
            else:
                r = (a.astype(np.uint64) * b.astype(np.uint64) >> np.uint64(32)).astype(np.int64)
        elif base == "sand":
            r = a & b
        elif base == "sor":
            r = a | b
        elif base == "sxor":
            r = a ^ b
        elif base == "sshll":
            r = np.where(b < 32, a << np.minimum(b, 31), 0)
        elif base == "sshrl":
            r = np.where(b < 32, a >> np.minimum(b, 31), 0)
        elif base == "sshra":
            r = _signed(a) >> np.minimum(b, 31)
        elif base in ("smin", "smax"):
            fn = np.minimum if base == "smin" else np.maximum
            r = fn(_signed(a), _signed(b)) if op.endswith("s32") else fn(a, b)
        else:
            return None
        return r & _MASK32

    def _table_load(self, address: str, depth: int) -> np.ndarray | None:
        """The words an ``sld [smem:[#allocationN + %sI]]`` reads, where the allocation holds
        a constant table; None elsewhere. An index past the table's ends reads its nearest
        entry, on at most `_FILL_DRAIN` iterations: a pipeline's fill or drain, whose stage
        does not run the body (a grid index of stage 1 is -1 in the first iteration)."""
        m = _TABLE_LOAD_RE.fullmatch(address)
        table = self.defs.tables.get(m["alloc"]) if m else None
        if table is None:
            return None
        index = self.value(m["index"], depth + 1) if m["index"] else np.zeros_like(self.iters)
        if index is None:
            return None
        index = _signed(index)
        if np.count_nonzero((index < 0) | (index >= len(table))) > _FILL_DRAIN:
            return None
        return np.asarray(table, dtype=np.int64)[np.clip(index, 0, len(table) - 1)] & _MASK32

    def _divrem(self, name: str, source: str, depth: int) -> np.ndarray | None:
        """The value ``name`` pops from the divider: ``a // b`` first, ``a % b`` second."""
        divide = self.defs.defs.get(source)
        popped = self.defs.pops[source].index(name)  # 0: the quotient, 1: the remainder
        if divide is None or divide.opcode != "sdivrem.u32" or popped > 1:
            return None
        a, b = (self.value(o, depth + 1) for o in self.defs.operands(divide))
        if a is None or b is None or not np.all(b):
            return None
        return a // b if popped == 0 else a % b

    def pred(self, name: str, depth: int = 0) -> np.ndarray | None:
        """Boolean values of predicate ``name`` (``!`` allowed) per iteration."""
        if name.startswith("!"):
            r = self.pred(name[1:], depth + 1)
            return None if r is None else ~r
        name = self.defs.resolve(name)
        key = "?" + name
        if key in self.cache:
            return self.cache[key]
        self.cache[key] = None
        result = self._compute_pred(name, depth) if depth < 200 else None
        self.cache[key] = result
        return result

    def _compute_pred(self, name: str, depth: int) -> np.ndarray | None:
        ins = self._usable(self.defs.defs.get(name))
        if ins is None:
            return None
        ops = self.defs.operands(ins)
        m = CMP_RE.match(ins.opcode)
        if m:
            if len(ops) != 2:
                return None
            a, b = self.value(ops[0], depth + 1), self.value(ops[1], depth + 1)
            if a is None or b is None:
                return None
            if m["ty"] == "s32":
                a, b = _signed(a), _signed(b)
            return {
                "lt": a < b,
                "le": a <= b,
                "gt": a > b,
                "ge": a >= b,
                "eq": a == b,
                "ne": a != b,
            }[m["cc"]]
        base = ins.base
        if base == "smov":  # a predicate cannot come from an smov; be safe
            return None
        vals = [self.pred(o, depth + 1) for o in ops]
        if any(v is None for v in vals):
            return None
        if base in ("pneg", "pmov") and len(vals) == 1:
            return ~vals[0] if base == "pneg" else vals[0]
        if len(vals) != 2:
            return None
        a, b = vals
        table = {
            "por": lambda: a | b,
            "pand": lambda: a & b,
            "pnand": lambda: ~(a & b),
            "pnor": lambda: ~(a | b),
            "pxor": lambda: a ^ b,
        }
        return table[base]() if base in table else None


@dataclasses.dataclass
class LoopEval:
    """Region predicates of one loop evaluated over all its iterations."""

    skipped: list[int | None]  # per region: iterations taking its branch (None: undecided)
    executed: list[int | None]  # per region: iterations running it (it and its parents not taken)
    counter_only: list[bool]  # per region: predicate depends on the loop counter only
    patterns: dict[tuple[bool, ...], int]  # skip pattern of the decided regions -> iterations


@dataclasses.dataclass(frozen=True)
class LoopContext:
    """What evaluated a loop's regions: enough to evaluate more predicates or weigh bundles."""

    defs: Defs
    counter: Counter
    trip: int
    grid: tuple[int, ...] | None  # trusted grid (None: grid indices undecidable)
    spans: list[tuple[int, int]]  # the loop's regions (start, end)
    predicates: list[str]  # their branch predicates
    result: LoopEval

    def evaluate(self, predicates: list[str], parents: list[list[int]]) -> LoopEval:
        """Evaluate other skip predicates over the same iterations (see `evaluate_loop`)."""
        return evaluate_loop(self.defs, self.counter, self.trip, self.grid, predicates, parents)


def _assuming_guards(
    strict: Evaluator, predicate: str, parent_skips: list[np.ndarray | None]
) -> np.ndarray | None:
    """A region's skip predicate read through predicated definitions, where that is exact for
    every iteration that reaches the region: each guard holds whenever no parent region is
    skipped (e.g. a compare inside the pipeline's compute guard, `_GUARD_MAX_SKIP_FRACTION`).
    On the other iterations the value is a guess, but an enclosing skipped region hides it."""
    if any(s is None for s in parent_skips):
        return None
    lax = Evaluator(
        strict.defs, strict.counter, strict.iters, strict.given_grid, assume_guards=True
    )
    k = lax.pred(predicate)
    if k is None:
        return None
    reached = np.ones(strict.iters.shape, dtype=bool)
    for s in parent_skips:
        reached &= ~s
    for guard in lax.assumed:
        ran = strict.pred(guard)
        if ran is None or not np.all(ran[reached]):
            return None
    return k


def evaluate_loop(
    defs: Defs,
    counter: Counter,
    trip: int,
    grid: tuple[int, ...] | None,
    predicates: list[str],
    parents: list[list[int]],
    *,
    assume_guards: bool = True,
) -> LoopEval:
    """Evaluate the branch predicates of a loop's regions, in chunks of iterations; a
    predicate computed under guards is decided where they hold (`_assuming_guards`) unless
    that differs between chunks (then none is: the evaluation is redone without)."""
    probe = np.arange(counter.start, counter.start + 1, dtype=np.int64)
    no_grid = Evaluator(defs, counter, probe, None)
    counter_only = [no_grid.pred(p) is not None for p in predicates]
    skipped: list[int | None] = [0] * len(predicates)
    executed: list[int | None] = [0] * len(predicates)
    patterns: dict[tuple[bool, ...], int] = {}
    decided: list[int] | None = None
    for c0 in range(0, trip, _EVAL_CHUNK):
        iters = np.arange(counter.start + c0, counter.start + min(trip, c0 + _EVAL_CHUNK))
        ev = Evaluator(defs, counter, iters.astype(np.int64), grid)
        skips = [ev.pred(p) for p in predicates]
        if assume_guards:
            skips = [
                k if k is not None else _assuming_guards(ev, p, [skips[j] for j in parents[i]])
                for i, (k, p) in enumerate(zip(skips, predicates, strict=True))
            ]
        if decided is None:  # without guards, decidability depends on the code only
            decided = [i for i, k in enumerate(skips) if k is not None]
        elif any(skips[i] is None for i in decided):
            return evaluate_loop(
                defs, counter, trip, grid, predicates, parents, assume_guards=False
            )
        for i, k in enumerate(skips):
            if k is None:
                skipped[i] = executed[i] = None
                continue
            skipped[i] = (skipped[i] or 0) + int(k.sum())
            run = ~k
            for j in parents[i]:
                if skips[j] is None:
                    run = None
                    break
                run = run & ~skips[j]
            executed[i] = (
                None if run is None or executed[i] is None else executed[i] + int(run.sum())
            )
        if decided:
            rows, counts = np.unique(
                np.stack([skips[i] for i in decided], axis=1), axis=0, return_counts=True
            )
            for row, n in zip(rows, counts, strict=True):
                key = tuple(bool(x) for x in row)
                patterns[key] = patterns.get(key, 0) + int(n)
        else:
            patterns[()] = patterns.get((), 0) + len(iters)
    return LoopEval(skipped, executed, counter_only, patterns)
