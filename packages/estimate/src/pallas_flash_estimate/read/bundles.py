"""The VLIW bundles of a libtpu ``...-final_bundles.txt`` dump: one `Bundle` per line.

The scheduled program lists one VLIW bundle per line::

    0x10 LB: > { %a = sst [smem:[#allocation15_spill]] %s13  ;;  %b = sadd.s32 1, %s24 }

The address is decimal (``0``) or hex (``0x10``) and counts bundles. An optional marker (``LB``
loop body, ``PF`` predicated-region fallthrough; the key also lists ``LH``, ``LE``, ``PB``,
``CT``) comes before the colon. The ``>`` characters give the loop nesting of the bundle, **but
only on bundles with non-control work**: empty bundles (``{}``) and the bundle holding a loop's
back-edge branch print no ``>`` even inside a loop (`evaluate.bundle_listing` finds
loop extents from the branches). Instructions are separated by ``;;``; comments (``/* .. */``)
may span lines (DMA descriptors with ``iteration_bounds: (1, 16, 8, 8)``): continuation lines
are no bundles.

No JAX import: this module only reads text.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["CMOV_RE", "Bundle", "Instruction", "scan_bundles"]

CMOV_RE = re.compile(r"^\(\s*(?P<pred>!?%p\w+)\s*,\s*(?P<old>[^)]+?)\s*\)\s*,\s*(?P<new>\S+)$")
"""A conditional move's operands: ``(%p38_p0, %s37_s25), 0``."""

_BUNDLE_RE = re.compile(
    r"^\s*(?P<addr>0x[0-9a-fA-F]+|\d+)\s+(?P<markers>(?:[A-Z]{2}\s*)*):\s*(?P<nest>>*)\s*\{"
)
_INSTR_RE = re.compile(
    r"^(?P<dest>%[\w.\-]+)\s*=\s*(?P<opcode>[A-Za-z_][\w.\-]*(?:\[\d+\][\w.\-]*)*)\s*(?P<args>.*)$"
)
"""An instruction with a result; its mnemonic may index a register file of the unit it names
(v7x: ``vmatmul.mubr.bf16.gmra.mrb[4].mxu0``, MXU 0's result buffer 4)."""
_GUARD_RE = re.compile(r"^\(\s*(?P<guard>!?%p\w+)\s*\)\s*,?\s*(?P<rest>.*)$", re.S)
_BRANCH_RE = re.compile(r"^\(\s*(?P<pred>!?%p\w+)\s*\)\s*target\s*=\s*\$region(?P<region>\d+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a bundle."""

    dest: str | None  # "%s22_s24"; None when the text has no "%x = " prefix
    opcode: str  # full mnemonic, e.g. "vmatmul.bf16.gmra.mxu0", "vpop.f32.mrb[0].mxu0"
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


def scan_bundles(text: str) -> tuple[Bundle, ...]:
    """The bundles of a ``final_bundles`` text, in order, each with its continuation lines."""
    return tuple(_make_bundle(i, rec) for i, rec in enumerate(_split_records(text)))
