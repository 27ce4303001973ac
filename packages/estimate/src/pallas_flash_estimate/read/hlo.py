"""Parse optimized HLO text (``compiled.as_text()``) into its computations and ops, and read
the bytes of its shapes (`read.hlo_ops` finds kernel calls, collectives
and copies among them).

The text is a module header, debug tables (``FileNames``, ``StackFrames``, ...) and computations::

    %fused_computation.1 (param_0.3: f32[4,2048,1]) -> f32[4,2048] {
      %param_0.3 = f32[4,2048,1]{1,2,0:T(1,128)S(1)} parameter(0)
      %copy.2 = f32[4,2048,1]{1,0,2:T(4,128)} copy(%param_0.3)
      ROOT %bitcast.2 = f32[4,2048]{1,0:T(4,128)S(1)} bitcast(%copy.2)
    }

    ENTRY %main.3 (q.1: bf16[4,2048,128], ...) -> (...) {
      ...
    }

An instruction may span lines (``frontend_attributes`` holding strings with newlines). Shapes carry
TPU layouts ``{minor-to-major:T(tiling)...S(memory space)}``: ``S(1)`` is VMEM on TPU, no ``S``
is HBM. A ``copy`` or ``copy-start`` whose source and result differ only in the memory space is a
memory-space-assignment prefetch (e.g. ``cross_program_prefetch_index=0``), not a re-layout;
:attr:`HloOp.relayout` tells the two apart.

No JAX import: this module only reads text.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

__all__ = [
    "Computation",
    "HloOp",
    "arrays",
    "callees",
    "entry_computation",
    "fused_computation",
    "hbm_bytes",
    "integer_constant",
    "largest_array_bytes",
    "layout_parts",
    "parse_computations",
    "parse_entry",
    "shape_bytes",
    "tuple_elements",
]

#: Bits per element of each HLO element type.
_DTYPE_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}
#: Opcodes that move data to a new layout or buffer.

_COMP_RE = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(")
_COMP_END_RE = re.compile(r"^\}(?:,.*)?\s*$")
"""A computation's closing brace, alone or with attributes (``}, execution_thread="sparsecore"``:
v7x's SparseCore computations)."""
_INSTR_START_RE = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=")
_INSTR_RE = re.compile(r"^\s*(?P<root>ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*")
_ARRAY_RE = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\](?P<layout>\{[^{}]*\})?")
_OPERAND_RE = re.compile(r"%([\w.\-]+)")
_COMMENT_RE = re.compile(r"/\*.*?\*/", re.S)
_CALLS_RE = re.compile(
    r"\b(?:calls|to_apply|body|condition)=\{?(?P<names>%[\w.\-]+(?:,\s*%[\w.\-]+)*)"
)
_TARGET_RE = re.compile(r'custom_call_target="(?P<target>[^"]*)"')
_KIND_RE = re.compile(r"\bkind=(?P<kind>\w+)")
_BRACKETS = {"(": ")", "{": "}", "[": "]"}


@dataclasses.dataclass(frozen=True)
class HloOp:
    """One HLO instruction."""

    name: str  # without the "%"
    opcode: str
    shape: str  # as printed, layout included
    bytes: int  # of the result; tuple shapes: the sum of their elements
    operands: tuple[str, ...]  # operand names, without "%"
    detail: str  # custom_call_target, fusion kind and callees, a scalar constant's value, ...
    relayout: bool | None = None  # copies: True if the data is re-laid out, False if it only
    # changes memory space; None for other ops
    computation: str = ""  # the computation holding it
    attributes: str = dataclasses.field(default="", repr=False, compare=False)  # raw text after
    # the operands (backend_config etc.)


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    entry: bool
    ops: tuple[HloOp, ...]

    def get(self, name: str) -> HloOp | None:
        for op in self.ops:
            if op.name == name:
                return op
        return None

    @property
    def root(self) -> HloOp | None:
        """The op whose result the computation returns: the last op no other op reads (the
        ``ROOT`` mark is not kept)."""
        read = {name for op in self.ops for name in op.operands}
        unread = [op for op in self.ops if op.name not in read and op.opcode != "parameter"]
        return unread[-1] if unread else None


# --------------------------------------------------------------------------------------------
# Shapes


def arrays(shape: str) -> list[tuple[str, list[int], str]]:
    """(dtype, dims, layout) of every array in a (possibly tuple) shape."""
    out = []
    for m in _ARRAY_RE.finditer(shape):
        dtype = m["dtype"]
        if dtype not in _DTYPE_BITS and not dtype.startswith("f8"):
            continue
        dims = [int(d.replace("<=", "").strip()) for d in m["dims"].split(",") if d.strip()]
        out.append((dtype, dims, m["layout"] or ""))
    return out


def _array_bytes(dtype: str, dims: list[int]) -> int:
    bits = _DTYPE_BITS.get(dtype, 8 if dtype.startswith("f8") else 0)
    n = 1
    for d in dims:
        n *= d
    return (n * bits + 7) // 8


def shape_bytes(shape: str) -> int:
    """Bytes of a shape; a tuple's are the sum of its elements (layouts and padding ignored)."""
    return sum(_array_bytes(dtype, dims) for dtype, dims, _ in arrays(shape))


def hbm_bytes(shape: str) -> int:
    """Bytes of a shape's arrays laid out in HBM: memory space 0, no ``S(n)`` in the layout
    (``S(1)`` is VMEM)."""
    return sum(
        _array_bytes(dtype, dims)
        for dtype, dims, layout in arrays(shape)
        if not re.search(r"S\((?!0\))\d+\)", layout)
    )


def largest_array_bytes(shape: str) -> int:
    """Bytes of a shape's largest array (an asynchronous collective's ``-start`` op returns
    its operand and its result as a tuple: the result is the larger)."""
    return max((_array_bytes(dtype, dims) for dtype, dims, _ in arrays(shape)), default=0)


def tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape (the shape itself when it is no tuple)."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    return _split_top(shape[1 : _match(shape, 0)])


def layout_parts(layout: str) -> tuple[str, str]:
    """(layout without memory space, memory space) of ``{3,2,1,0:T(8,128)(2,1)S(1)}``."""
    body = layout.strip("{}")
    m = re.search(r"S\((\d+)\)", body)
    space = m.group(1) if m else "0"
    return re.sub(r"S\(\d+\)", "", body), space


# --------------------------------------------------------------------------------------------
# Text scanning


def _string_end(text: str, j: int) -> int:
    """Index of the quote closing the string that opens at ``text[j]`` (escapes skipped)."""
    j += 1
    while j < len(text) and text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    return j


def _match(text: str, i: int) -> int:
    """Index of the bracket closing the one at ``text[i]`` (strings and comments skipped)."""
    stack = []
    j = i
    n = len(text)
    while j < n:
        c = text[j]
        if c == '"':
            j = _string_end(text, j)
        elif text.startswith("/*", j):
            k = text.find("*/", j + 2)
            j = n if k < 0 else k + 1
        elif c in _BRACKETS:
            stack.append(_BRACKETS[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return j
        j += 1
    return n


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets and strings."""
    parts, depth, start, j, n = [], 0, 0, 0, len(text)
    while j < n:
        c = text[j]
        if c == '"':
            j = _string_end(text, j)
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:j].strip())
            start = j + 1
        j += 1
    tail = text[start:].strip()
    if tail:
        parts.append(tail)
    return parts


_SPECIAL_RE = re.compile(r'\\.|"|[(){}\[\]]')


def _balanced(text: str) -> bool:
    """Whether every bracket and string opened in ``text`` is closed."""
    depth, in_string = 0, False
    for m in _SPECIAL_RE.finditer(text):
        tok = m.group(0)
        if tok.startswith("\\"):
            continue
        if tok == '"':
            in_string = not in_string
        elif not in_string:
            depth += 1 if tok in "({[" else -1
    return depth <= 0 and not in_string


def _parse_instruction(text: str, computation: str) -> HloOp | None:
    m = _INSTR_RE.match(text)
    if m is None:
        return None
    name = m["name"]
    rest = text[m.end() :].lstrip()
    if rest.startswith("("):
        end = _match(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
        rest = rest.lstrip()
    om = re.match(r"(?P<opcode>[\w\-]+)\(", rest)
    if om is None:
        return None
    opcode = om["opcode"]
    open_at = om.end() - 1
    close_at = _match(rest, open_at)
    operand_text = rest[open_at + 1 : close_at]
    attributes = rest[close_at + 1 :].lstrip(", ").strip()
    operands: tuple[str, ...] = ()
    if opcode != "constant":
        operands = tuple(_OPERAND_RE.findall(_COMMENT_RE.sub("", operand_text)))
    return HloOp(
        name=name,
        opcode=opcode,
        shape=shape,
        bytes=shape_bytes(shape),
        operands=operands,
        detail=_detail(opcode, attributes, operand_text, shape),
        computation=computation,
        attributes=attributes,
    )


def callees(attributes: str) -> list[str]:
    """The computations an op's attributes call (``calls=``, ``to_apply=``, ...), without
    the ``%``."""
    out = []
    for m in _CALLS_RE.finditer(attributes):
        out += [n.strip().lstrip("%") for n in m["names"].split(",")]
    return out


def _detail(opcode: str, attributes: str, operand_text: str, shape: str) -> str:
    if opcode == "constant":
        return _constant_detail(operand_text, shape)
    if opcode == "custom-call":
        m = _TARGET_RE.search(attributes)
        return m["target"] if m else ""
    if opcode == "fusion":
        kind = _KIND_RE.search(attributes)
        calls = callees(attributes)
        return " ".join(
            [*([f"kind={kind['kind']}"] if kind else []), *(f"calls=%{c}" for c in calls)]
        )
    for key in ("dimensions", "padding", "slice"):
        m = re.search(rf"\b{key}=(\{{[^}}]*\}}|\S+?)(?:,|$)", attributes)
        if m:
            return f"{key}={m.group(1)}"
    return ""


_INTEGER_DTYPES = ("s8", "s16", "s32", "s64", "u8", "u16", "u32", "u64")
_CONSTANT_ELEMENTS = 1 << 16


def _constant_detail(literal: str, shape: str) -> str:
    """An integer constant's value, ``value=528`` or ``value={1, 0, ...}`` as printed, up to
    `_CONSTANT_ELEMENTS` elements (a kernel's index tables, not a model's weights); ""
    otherwise."""
    found = arrays(shape)
    if len(found) != 1 or found[0][0] not in _INTEGER_DTYPES:
        return ""
    return f"value={literal.strip()}" if math.prod(found[0][1]) <= _CONSTANT_ELEMENTS else ""


def integer_constant(op: HloOp) -> int | tuple[int, ...] | None:
    """The value of an integer ``constant`` op: an int for a scalar, its elements in row-major
    order for an array (None: not an integer constant, too large, or not printed whole)."""
    found = arrays(op.shape)
    if op.opcode != "constant" or not op.detail.startswith("value=") or len(found) != 1:
        return None
    values = tuple(int(v) for v in re.findall(r"-?\d+", op.detail.removeprefix("value=")))
    if not found[0][1]:
        return values[0] if len(values) == 1 else None
    return values if len(values) == math.prod(found[0][1]) else None


_FUSED_RE = re.compile(r"\bcalls=%(?P<name>[\w.\-]+)")


def fused_computation(op: HloOp, comps: Mapping[str, Computation]) -> Computation | None:
    """The computation a fusion (or other op with ``calls=``) runs, if the module has it."""
    match = _FUSED_RE.search(op.attributes)
    return comps.get(match["name"]) if match else None


def parse_computations(text: str) -> dict[str, Computation]:
    """Every computation of an HLO module, in order, keyed by name (without ``%``)."""
    comps: dict[str, Computation] = {}
    current: str | None = None
    entry = False
    ops: list[HloOp] = []
    buf: list[str] = []

    def flush() -> None:
        if buf and current is not None:
            op = _parse_instruction(" ".join(s.strip() for s in buf), current)
            if op is not None:
                ops.append(op)
        buf.clear()

    for line in text.splitlines():
        if current is None:
            m = _COMP_RE.match(line)
            if m and line.rstrip().endswith("{"):
                current, entry, ops = m["name"], bool(m["entry"]), []
            continue
        if buf and not _balanced(" ".join(buf)):
            buf.append(line)  # an instruction spanning lines
            continue
        if _COMP_END_RE.match(line):
            flush()
            comps[current] = Computation(current, entry, tuple(ops))
            current = None
            continue
        if _INSTR_START_RE.match(line):
            flush()
            buf.append(line)
        elif buf:
            buf.append(line)
    return comps


def entry_computation(comps: dict[str, Computation]) -> Computation:
    """The ``ENTRY`` computation of ``parse_computations``'s result."""
    for comp in comps.values():
        if comp.entry:
            return comp
    raise ValueError("no ENTRY computation in the HLO text")


def parse_entry(text: str) -> list[HloOp]:
    """The ENTRY computation's instructions, in order."""
    return list(entry_computation(parse_computations(text)).ops)


# --------------------------------------------------------------------------------------------
# Copy trap
