"""How much of a program's collective and copy time its own schedule hides: a replay of the
schedule.

`whole_program` reports a step at two ends, every collective hidden under compute and none.
The compiled HLO says more: XLA's latency-hiding scheduler splits a collective into a start
and a done (``all-gather-start``/``-done``, or the ``async-collective-start``/``-done``
fusions with continuation fusions between them that share its ``channel_id``) and places
compute between the two; its memory-space assignment does the same with the copies that
prefetch weights into VMEM (``slice-start``/``copy-start`` and their dones). This module
replays each sequential computation in program order on one chip:

- a compute op advances the clock by its time (one run: ``max(static, HBM)``, as
  `whole_program` charges it);
- a collective's start launches it on the interconnect when the previous collective is done
  (collectives queue on the ICI, one at a time) and for its modelled time (`ici`); its done
  waits for it; a collective without a start/done pair (a synchronous op) waits at once;
- an asynchronous copy's start queues its HBM time (its bytes over the bandwidth); the
  queue drains, first in first out, at the HBM bandwidth the chip leaves idle: an op's time
  less its own HBM time, and all of any wait. Its done waits for what is left of it and of
  the copies queued before it, at the full bandwidth;
- a ``while`` loop runs its body's steady-state iteration (the second of two replayed, so a
  collective started in one iteration and awaited in the next is counted as it runs) times
  its trip count (`program_loops`);
- a ``conditional`` runs each branch in turn, its ops' and copies' times scaled by the
  branch's share of the runs when `program_loops` has one (collectives in a branch are
  replayed whole).

The replay rests on the ICI model's figures and on three more assumptions, stated where it is
reported: a collective in flight does not slow the compute beside it (no HBM or core
contention), one collective at a time uses the links, and a copy takes only the HBM time an
op leaves unused (ops and copies share the bandwidth, neither slows the other's issue). Its
step lies between the two ends: every collective hidden (copies as scheduled) and nothing
hidden (copies serial).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from pallas_flash_estimate.evaluate.program_loops import (
    ProgramRuns,
    branches,
    callees,
    is_async_start,
)
from pallas_flash_estimate.read.hlo import Computation, HloOp
from pallas_flash_estimate.read.hlo_ops import COLLECTIVES


def _role(op: HloOp) -> str:
    """``start``, ``done``, ``sync`` (a collective op that waits for itself) or ``continue``
    (a fusion that carries a collective's data between its start and its done)."""
    if op.opcode.endswith("-start") or is_async_start(op):
        return "start"
    if op.opcode.endswith("-done") or op.name.startswith("async-collective-done"):
        return "done"
    return "sync" if op.opcode in COLLECTIVES else "continue"


@dataclasses.dataclass
class _Clock:
    """The replay's state: the compute clock, when the links are next free, when each
    collective in flight is done, and the copies queued for HBM (name, seconds left)."""

    now: float = 0.0
    links_free: float = 0.0
    in_flight: dict[str, float] = dataclasses.field(default_factory=dict)
    copies: list[list] = dataclasses.field(default_factory=list)

    def advance(self, seconds: float, hbm_seconds: float = 0.0) -> None:
        """Moves the clock on by an op's ``seconds``, its HBM busy ``hbm_seconds`` of them:
        the rest drains the copy queue."""
        self.now += seconds
        spare = max(seconds - hbm_seconds, 0.0)
        while self.copies and spare > 0.0:
            taken = min(self.copies[0][1], spare)
            self.copies[0][1] -= taken
            spare -= taken
            if self.copies[0][1] <= 0.0:
                self.copies.pop(0)

    def await_copy(self, name: str) -> None:
        """A copy's done: the copies queued up to ``name`` finish at the full bandwidth."""
        names = [queued for queued, _ in self.copies]
        if name not in names:
            return
        ahead = self.copies[: names.index(name) + 1]
        del self.copies[: len(ahead)]
        self.now += sum(left for _, left in ahead)

    def shift(self, seconds: float, before: _Clock) -> None:
        """Moves on by ``seconds`` (the iterations of a loop not replayed) the clock and what
        the loop launched; a collective in flight since ``before`` (the clock on entering
        the loop) keeps its end, and the links their time if the loop launched nothing."""
        self.now += seconds
        if self.links_free != before.links_free:
            self.links_free += seconds
        self.in_flight = {
            key: end if before.in_flight.get(key) == end else end + seconds
            for key, end in self.in_flight.items()
        }


@dataclasses.dataclass(frozen=True)
class ScheduleReplay:
    """Replays a program (`replay`); built from its parsed computations, loop runs, which
    collective each op takes part in, each op's time of one run and each collective's
    modelled time of one run; with ``copy_seconds`` (a copy's start -> its HBM time of one
    run) the copies are replayed beside the ops (``op_hbm_seconds``: an op's HBM time of one
    run), without it they are ops like the others."""

    comps: Mapping[str, Computation]
    runs: ProgramRuns
    keys: Mapping[str, str]  # op name -> its collective (`program_loops.collective_keys`)
    op_seconds: Mapping[str, float]
    collective_seconds: Mapping[str, float]
    copy_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    op_hbm_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def replay(self) -> float:
        """Seconds of one step: the entry computation replayed, its last collectives awaited."""
        clock = _Clock()
        entry = next(c for c in self.comps.values() if c.entry)
        self._run(entry, clock)
        for name, _ in list(clock.copies):
            clock.await_copy(name)
        return max([clock.now, *clock.in_flight.values()])

    def _run(self, comp: Computation, clock: _Clock, share: float = 1.0) -> None:
        """Replays ``comp``'s ops, each op's time scaled by ``share`` (a branch's share)."""
        for op in comp.ops:
            if op.opcode in ("while", "conditional"):
                self._control(op, clock)
                continue
            if op.name in self.copy_seconds:
                clock.copies.append([op.name, share * self.copy_seconds[op.name]])
                continue
            if op.opcode.endswith("-done") and op.operands and op.operands[0] in self.copy_seconds:
                clock.await_copy(op.operands[0])
                continue
            key, role = self.keys.get(op.name), _role(op)
            if key is not None and role == "continue" and key not in clock.in_flight:
                role = "sync"  # a collective fusion with no start before it waits for itself
            if key is not None and role in ("start", "sync"):
                begin = max(clock.now, clock.links_free)
                clock.links_free = begin + self.collective_seconds.get(key, 0.0)
                clock.in_flight[key] = clock.links_free
            clock.advance(share * self.op_seconds.get(op.name, 0.0),
                          share * self.op_hbm_seconds.get(op.name, 0.0))  # fmt: skip
            if key is not None and role in ("done", "sync"):
                clock.advance(max(clock.in_flight.pop(key, clock.now) - clock.now, 0.0))

    def _control(self, op: HloOp, clock: _Clock) -> None:
        """A loop: its steady-state iteration times its trips; a conditional: every branch
        in turn, each its share of the runs (as `whole_program` charges them)."""
        shares = self.runs.shares.get(op.name)
        for i, name in enumerate(branches(op)):
            if name in self.comps:
                self._run(self.comps[name], clock, 1.0 if shares is None else shares[i])
        parts = [(name, how) for name, how in callees(op) if name in self.comps]
        iteration = [self.comps[name] for how in ("condition", "body")
                     for name, part in parts if part == how]  # fmt: skip
        if not iteration:
            return
        trips = self.runs.trips.get(op.name)
        trips = 1 if trips is None else trips  # undetermined: once, as whole_program counts it
        before = dataclasses.replace(clock, in_flight=dict(clock.in_flight))
        for _ in range(min(trips, 2)):
            first = clock.now
            for comp in iteration:
                self._run(comp, clock)
        if trips > 2:
            clock.shift((trips - 2) * (clock.now - first), before)
