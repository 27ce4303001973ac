"""How much of a program's collective time its own schedule hides: a replay of the schedule.

`whole_program` reports a step at two ends, every collective hidden under compute and none.
The compiled HLO says more: XLA's latency-hiding scheduler splits a collective into a start
and a done (``all-gather-start``/``-done``, or the ``async-collective-start``/``-done``
fusions with continuation fusions between them that share its ``channel_id``) and places
compute between the two. This module replays each sequential computation in program order on
one chip:

- a compute op advances the clock by its time (one run: ``max(static, HBM)``, as
  `whole_program` charges it);
- a collective's start launches it on the interconnect when the previous collective is done
  (collectives queue on the ICI, one at a time) and for its modelled time (`ici`); its done
  waits for it; a collective without a start/done pair (a synchronous op) waits at once;
- a ``while`` loop runs its body's steady-state iteration (the second of two replayed, so a
  collective started in one iteration and awaited in the next is counted as it runs) times
  its trip count (`program_loops`).

The replay rests on the ICI model's figures and on two more assumptions, stated where it is
reported: a collective in flight does not slow the compute beside it (no HBM or core
contention), and one collective at a time uses the links. Its step lies between the two ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from pallas_flash_bench.hlo import COLLECTIVES, Computation, HloOp
from pallas_flash_bench.program_loops import ProgramRuns, callees, is_async_start


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
    """The replay's state: the compute clock, when the links are next free, and when each
    collective in flight is done."""

    now: float = 0.0
    links_free: float = 0.0
    in_flight: dict[str, float] = dataclasses.field(default_factory=dict)

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
    modelled time of one run."""

    comps: Mapping[str, Computation]
    runs: ProgramRuns
    keys: Mapping[str, str]  # op name -> its collective (`program_loops.collective_keys`)
    op_seconds: Mapping[str, float]
    collective_seconds: Mapping[str, float]

    def replay(self) -> float:
        """Seconds of one step: the entry computation replayed, its last collectives awaited."""
        clock = _Clock()
        entry = next(c for c in self.comps.values() if c.entry)
        self._run(entry, clock)
        return max([clock.now, *clock.in_flight.values()])

    def _run(self, comp: Computation, clock: _Clock) -> None:
        for op in comp.ops:
            if op.opcode in ("while", "conditional"):
                self._control(op, clock)
                continue
            key, role = self.keys.get(op.name), _role(op)
            if key is not None and role == "continue" and key not in clock.in_flight:
                role = "sync"  # a collective fusion with no start before it waits for itself
            if key is not None and role in ("start", "sync"):
                begin = max(clock.now, clock.links_free)
                clock.links_free = begin + self.collective_seconds.get(key, 0.0)
                clock.in_flight[key] = clock.links_free
            clock.now += self.op_seconds.get(op.name, 0.0)
            if key is not None and role in ("done", "sync"):
                clock.now = max(clock.now, clock.in_flight.pop(key, clock.now))

    def _control(self, op: HloOp, clock: _Clock) -> None:
        """A loop: its steady-state iteration times its trips; a conditional: every branch
        in turn (as `whole_program` charges them)."""
        parts = [(name, how) for name, how in callees(op) if name in self.comps]
        for name, how in parts:
            if how == "branch":
                self._run(self.comps[name], clock)
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
