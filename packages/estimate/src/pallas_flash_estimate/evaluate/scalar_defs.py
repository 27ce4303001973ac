"""The scalar definitions of a bundle listing: each register's defining instruction, loop
counters and a loop's trip count.

`Defs` maps every scalar register to the instruction that defines it (through spill slots:
a register filled from a slot is the value stored there) and knows the constants: literals,
the scalar operands the kernel is called with where their values are known, and what is
computed from those (`Defs.constant`). `counter` finds a loop counter
(an ``sphi`` stepped by a constant) and `trip_count` reads a loop's exit test. `scalar_flow`
evaluates registers and predicates on them for every iteration.

No JAX import: this module only reads text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

from pallas_flash_estimate.read.bundles import Bundle, Instruction

__all__ = ["CMP_RE", "INT_RE", "Counter", "Defs", "trip_count"]

_SPILL_STORE_RE = re.compile(r"^\[smem:\[(?P<slot>#allocation\d+_spill)\]\]\s*(?P<value>%s\w+)$")
_FILL_RE = re.compile(r"^\[smem:\[(?P<slot>#allocation\d+_spill)\]\]$")
CMP_RE = re.compile(r"^scmp\.(?P<cc>lt|le|gt|ge|eq|ne)\.(?P<ty>[su]32)")
"""A scalar compare's opcode: ``scmp.lt.s32`` (condition, operand type)."""
INT_RE = re.compile(r"^-?\d+$")
"""An integer literal operand."""
_OPERAND_RE = re.compile(
    r"^(?:<no memory space> |\w+ )?\[shape: (?P<type>\w+)\[(?P<scalar>\]?)[^\]]*\]?, "
    r"index: (?P<index>\d+),"
)
"""A kernel operand's definition: ``inlined_call_operand.vmem [shape: s32[528], index: 1,
...]`` (``scalar``: empty dims)."""
_TO_SMEM = ("dma.vmem_to_smem", "dma.hbm_to_smem")
_ADDRESS_RE = re.compile(r"\[(?P<alloc>#allocation\d+)\]")
_ALLOC_RE = re.compile(r"smem:\[(#allocation\d+)(?![\w])")
_FOLDED = {
    "sadd": lambda a, b: a + b,
    "ssub": lambda a, b: a - b,
    "smul": lambda a, b: a * b,
    "sshll": lambda a, b: a << b if 0 <= b < 32 else 0,
}
"""The arithmetic `Defs.constant` folds (on 32-bit integers)."""


class Defs:
    """SSA definitions of a listing: ``%x`` -> defining instruction.

    ``operands``: the values of the kernel's integer constant operands (operand index -> an
    int, or an array's elements), where the program's HLO gives them
    (`read.hlo_ops.kernel_constant_operands`). A scalar one is a constant; an array one
    copied whole into an SMEM allocation, and nothing else written there, makes that
    allocation a constant table (`tables`), whose loads `scalar_flow` evaluates.
    """

    def __init__(
        self,
        bundles: Iterable[Bundle],
        operands: Mapping[int, int | tuple[int, ...]] | None = None,
    ):
        bundles = list(bundles)
        operands = operands or {}
        self.defs: dict[str, Instruction] = {}
        self.operands_known: dict[str, int] = {}  # registers holding a known scalar operand
        arrays: dict[str, tuple[int, ...]] = {}  # registers holding a known 32-bit array's address
        # a divide's ``sdivrem`` -> the registers its ``spop.drf``s pop (quotient, remainder)
        self.pops: dict[str, list[str]] = {}
        stored: dict[str, set[str]] = {}  # spill slot -> registers stored to it
        for b in bundles:
            for ins in b.instructions:
                if ins.dest is not None:
                    self.defs.setdefault(ins.dest, ins)
                    m = _OPERAND_RE.match(ins.args)
                    value = operands.get(int(m["index"])) if m else None
                    if ins.opcode.startswith("inlined_call_operand.") and value is not None:
                        if isinstance(value, int) and m["scalar"]:
                            self.operands_known[ins.dest] = value
                        elif isinstance(value, tuple) and m["type"] in ("s32", "u32"):
                            arrays[ins.dest] = value
                    if ins.opcode == "spop.drf":
                        self.pops.setdefault(ins.args.strip(), []).append(ins.dest)
                if ins.opcode == "sst" and ins.guard is None:
                    m = _SPILL_STORE_RE.match(ins.args)
                    if m:
                        stored.setdefault(m["slot"], set()).add(m["value"])
        # A spill slot stored from one register only ever holds that register's value.
        self.slots = {slot: next(iter(v)) for slot, v in stored.items() if len(v) == 1}
        self.tables = self._tables(bundles, arrays)

    def _tables(
        self, bundles: list[Bundle], arrays: Mapping[str, tuple[int, ...]]
    ) -> dict[str, tuple[int, ...]]:
        """SMEM allocation -> the constant array every write to it copies in whole: each
        use of the allocation's address (``smov [#allocationN]``, or the literal) is a
        ``dma.vmem_to_smem`` or ``dma.hbm_to_smem`` of one array operand's whole buffer
        (``sshll`` of its address by 4, as the kernel's prologue passes it; granules of 32
        bytes), and nothing stores to it."""
        addresses = {
            ins.dest: m["alloc"]
            for b in bundles
            for ins in b.instructions
            if ins.opcode == "smov" and ins.dest and (m := _ADDRESS_RE.fullmatch(ins.args))
        }
        copies: dict[str, set[tuple[int, ...] | None]] = {}
        for b in bundles:
            for ins in b.instructions:
                if ins.opcode in _TO_SMEM:  # source, size_in_granules (32 bytes), smem, flag
                    src, granules, dst, *_ = [*self.operands(ins), "", "", ""]
                    address = _ADDRESS_RE.fullmatch(dst)
                    alloc = address["alloc"] if address else addresses.get(self.resolve(dst))
                    table = arrays.get(self._address_of(src) or "")
                    whole = table is not None and INT_RE.match(granules) is not None
                    whole = whole and int(granules) * 8 >= len(table)
                    if alloc is not None:
                        copies.setdefault(alloc, set()).add(table if whole else None)
                    continue
                if ins.opcode == "smov":
                    continue  # an address taken, not a write
                for alloc in _ALLOC_RE.findall(ins.args):
                    if ins.opcode != "sld":
                        copies.setdefault(alloc, set()).add(None)
                for reg in re.findall(r"%s\w+", ins.args):
                    if reg in addresses and ins.opcode != "sld":
                        copies.setdefault(addresses[reg], set()).add(None)
        return {
            alloc: next(iter(found))
            for alloc, found in copies.items()
            if len(found) == 1 and None not in found
        }

    def _address_of(self, pointer: str) -> str | None:
        """The register whose buffer ``pointer`` points at: through ``int_to_ptr`` and the
        prologue's ``sshll ..., 4`` of an operand's address."""
        ins = self.get(pointer)
        if ins is not None and ins.opcode.startswith("int_to_ptr"):
            ins = self.get(ins.args.split()[-1])
        if ins is None or not ins.opcode.startswith("sshll"):
            return None
        ops = self.operands(ins)
        return self.resolve(ops[0]) if len(ops) == 2 and ops[1] == "4" else None

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

    def constant(self, name: str, depth: int = 0) -> int | None:
        """The value of operand ``name`` if it is the same in every run of the kernel: a
        literal, a known scalar operand, or a sum, difference, product or left shift of
        such (folded on 32 bits, as signed); else None."""
        if INT_RE.match(name):
            return int(name)
        name = self.resolve(name)
        if name in self.operands_known:
            return self.operands_known[name]
        ins = self.defs.get(name)
        if ins is not None and ins.opcode == "smov" and INT_RE.match(ins.args):
            return int(ins.args)
        if ins is None or ins.guard is not None:
            return None
        fold = _FOLDED.get(ins.opcode.split(".", 1)[0])
        ops = self.operands(ins)
        if fold is None or len(ops) != 2 or depth > 16:
            return None
        a, b = (self.constant(o, depth + 1) for o in ops)
        if a is None or b is None:
            return None
        value = fold(a, b) & 0xFFFFFFFF
        return value - (1 << 32) if value >= 1 << 31 else value

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
