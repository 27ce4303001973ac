"""The scalar definitions of a bundle listing: each register's defining instruction, loop
counters and a loop's trip count.

`Defs` maps every scalar register to the instruction that defines it (through spill slots:
a register filled from a slot is the value stored there), `counter` finds a loop counter
(an ``sphi`` stepped by a constant) and `trip_count` reads a loop's exit test. `scalar_flow`
evaluates registers and predicates on them for every iteration.

No JAX import: this module only reads text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from pallas_flash_estimate.read.bundles import Bundle, Instruction

__all__ = ["CMP_RE", "INT_RE", "Counter", "Defs", "trip_count"]

_SPILL_STORE_RE = re.compile(r"^\[smem:\[(?P<slot>#allocation\d+_spill)\]\]\s*(?P<value>%s\w+)$")
_FILL_RE = re.compile(r"^\[smem:\[(?P<slot>#allocation\d+_spill)\]\]$")
CMP_RE = re.compile(r"^scmp\.(?P<cc>lt|le|gt|ge|eq|ne)\.(?P<ty>[su]32)")
"""A scalar compare's opcode: ``scmp.lt.s32`` (condition, operand type)."""
INT_RE = re.compile(r"^-?\d+$")
"""An integer literal operand."""


class Defs:
    """SSA definitions of a listing: ``%x`` -> defining instruction."""

    def __init__(self, bundles: Iterable[Bundle]):
        self.defs: dict[str, Instruction] = {}
        # a divide's ``sdivrem`` -> the registers its ``spop.drf``s pop (quotient, remainder)
        self.pops: dict[str, list[str]] = {}
        stored: dict[str, set[str]] = {}  # spill slot -> registers stored to it
        for b in bundles:
            for ins in b.instructions:
                if ins.dest is not None:
                    self.defs.setdefault(ins.dest, ins)
                    if ins.opcode == "spop.drf":
                        self.pops.setdefault(ins.args.strip(), []).append(ins.dest)
                if ins.opcode == "sst" and ins.guard is None:
                    m = _SPILL_STORE_RE.match(ins.args)
                    if m:
                        stored.setdefault(m["slot"], set()).add(m["value"])
        # A spill slot stored from one register only ever holds that register's value.
        self.slots = {slot: next(iter(v)) for slot, v in stored.items() if len(v) == 1}

    def link_fills(
        self,
        bundles: Iterable[Bundle],
        loops: Iterable[tuple[int, int]],
        regions: Iterable[tuple[int, int]],
    ) -> None:
        """Give the fills of a spill slot stored from several registers the value that reaches
        them, where the listing's order decides it (the slot is reused for other values).

        A fill at bundle ``i`` reads the last store to its slot before ``i``; where none lies
        between the head of ``i``'s innermost loop and ``i``, it reads, like an ``sphi``, the
        store before the loop on the first iteration and the loop body's last store on the
        others (a loop counter kept in a spill slot). A store counts only when it is not
        predicated and every loop and predicated region (``(start, end)`` bundle spans) around
        it also holds the fill; else the fill stays undecidable."""
        loops, regions = list(loops), list(regions)
        stores: dict[str, list[tuple[int, str | None]]] = {}  # slot -> (bundle, value)
        fills: list[tuple[int, Instruction, str]] = []
        for b in bundles:
            for ins in b.instructions:
                if ins.opcode == "sst" and (m := _SPILL_STORE_RE.match(ins.args)):
                    stores.setdefault(m["slot"], []).append(
                        (b.index, m["value"] if ins.guard is None else None)
                    )
                elif (
                    ins.opcode == "sld"
                    and ins.guard is None
                    and ins.dest is not None
                    and (m := _FILL_RE.match(ins.args))
                    and m["slot"] not in self.slots
                ):
                    fills.append((b.index, ins, m["slot"]))

        def around(index: int) -> list[tuple[int, int]]:
            return [s for s in (*loops, *regions) if s[0] <= index <= s[1]]

        def reaching(slot: str, before: int, at: int, lowest: int = -1) -> str | None:
            """The value of the last store to ``slot`` in [lowest, before) seen at ``at``."""
            found = [(j, v) for j, v in stores.get(slot, []) if lowest <= j < before]
            if not found:
                return None
            j, value = found[-1]
            inside = all(s[0] <= at <= s[1] for s in around(j))
            return value if inside else None

        for index, ins, slot in fills:
            inside = [lp for lp in loops if lp[0] <= index <= lp[1]]
            head = min(inside, key=lambda lp: lp[1] - lp[0], default=None)
            if head is not None and not any(head[0] <= j < index for j, _ in stores.get(slot, [])):
                first = reaching(slot, head[0], head[0])
                again = reaching(slot, head[1] + 1, head[1], lowest=index)
                if first is not None and again is not None:
                    self.defs[ins.dest] = dataclasses.replace(
                        ins, opcode="sphi", args=f"{first}, {again}", note="spill slot, loop head"
                    )
                continue
            value = reaching(slot, index, index)
            if value is not None:
                self.defs[ins.dest] = dataclasses.replace(ins, opcode="smov", args=value)

    def resolve(self, name: str) -> str:
        """Follow plain copies (``smov %x``) and spill/fill round trips to the original value."""
        for _ in range(64):
            ins = self.defs.get(name)
            if ins is None or ins.guard is not None:
                return name
            if ins.opcode == "smov" and re.fullmatch(r"%s\w+", ins.args):
                name = ins.args
            elif (
                ins.opcode == "sld" and (m := _FILL_RE.match(ins.args)) and m["slot"] in self.slots
            ):
                name = self.slots[m["slot"]]
            else:
                return name
        return name

    def get(self, name: str) -> Instruction | None:
        return self.defs.get(self.resolve(name))

    @staticmethod
    def operands(ins: Instruction) -> list[str]:
        return [a.strip() for a in ins.args.split(",")]

    def constant(self, name: str) -> int | None:
        if INT_RE.match(name):
            return int(name)
        ins = self.get(name)
        if ins is not None and ins.opcode == "smov" and INT_RE.match(ins.args):
            return int(ins.args)
        return None

    def is_increment(self, name: str, phi: str) -> bool:
        """Whether ``name`` holds ``phi + 1``."""
        ins = self.get(name)
        if ins is None or not ins.opcode.startswith("sadd") or ins.guard is not None:
            return False
        ops = self.operands(ins)
        if len(ops) != 2 or "1" not in ops:
            return False
        return self.resolve(ops[1] if ops[0] == "1" else ops[0]) == phi

    def counter(self, name: str) -> tuple[str, str, int] | None:
        """If ``name`` is a loop counter phi or its increment: (phi, next, offset of name)."""
        name = self.resolve(name)
        ins = self.defs.get(name)
        if ins is None:
            return None
        if ins.opcode == "sphi":
            for other in self.operands(ins):
                if self.is_increment(other, name):
                    return name, self.resolve(other), 0
            return None
        if ins.opcode.startswith("sadd"):
            for op in self.operands(ins):
                phi = self.resolve(op)
                phi_ins = self.defs.get(phi)
                if (
                    phi_ins is not None
                    and phi_ins.opcode == "sphi"
                    and self.is_increment(name, phi)
                    and any(self.resolve(o) == name for o in self.operands(phi_ins))
                ):
                    return phi, name, 1
        return None

    def counter_start(self, phi: str, nxt: str) -> int | None:
        ins = self.defs.get(phi)
        if ins is None:
            return None
        starts = [self.constant(o) for o in self.operands(ins) if self.resolve(o) != nxt]
        return starts[0] if len(starts) == 1 else None


@dataclasses.dataclass(frozen=True)
class Counter:
    phi: str  # the counter's value during an iteration
    start: int  # its value in the first iteration; it steps by 1


def trip_count(defs: Defs, predicate: str) -> tuple[int | None, Counter | None]:
    """Trip count of a loop whose back-edge is taken when ``predicate`` holds, and its counter."""
    negated = predicate.startswith("!")
    ins = defs.get(predicate.lstrip("!"))
    if ins is None or ins.guard is not None:
        return None, None
    m = CMP_RE.match(ins.opcode)
    ops = defs.operands(ins)
    if m is None or len(ops) != 2:
        return None, None
    ctr = defs.counter(ops[0])
    if ctr is None:
        return None, None
    phi, nxt, offset = ctr
    start = defs.counter_start(phi, nxt)
    if start is None:
        return None, None
    counter = Counter(phi, start)
    bound = defs.constant(ops[1])
    if bound is None:
        return None, counter
    # The back-edge is taken while cont(v) holds, v = counter + offset, after each body.
    cc = m["cc"]
    cont = {"ge": "lt", "gt": "le", "eq": "ne"}.get(cc) if negated else cc
    if cont not in ("lt", "le", "ne"):
        return None, counter
    first = start + offset
    if cont == "ne" and first > bound:
        return None, counter
    last_ok = bound - 1 if cont in ("lt", "ne") else bound  # largest v that continues
    return max(1, last_ok - first + 2), counter
