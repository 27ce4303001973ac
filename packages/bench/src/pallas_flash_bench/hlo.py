"""Read optimized HLO text (``compiled.as_text()``): the entry computation, its kernel calls and
the "copy trap", the ops that copy or re-lay-out data around the kernels.

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
import json
import re
from collections.abc import Mapping

__all__ = [
    "Computation",
    "HloOp",
    "cost_estimate",
    "find_copy_trap",
    "kernel_body",
    "kernel_calls",
    "parse_computations",
    "parse_entry",
    "relayout_copies",
    "shape_bytes",
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
_COPY_OPCODES = ("copy", "copy-start", "copy-done", "transpose", "pad")
_INNER_COPY_OPCODES = ("copy", "transpose", "pad")

_COMP_RE = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(")
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
    detail: str  # custom_call_target, fusion kind and callees, copy direction, ...
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


def _arrays(shape: str) -> list[tuple[str, list[int], str]]:
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
    return sum(_array_bytes(dtype, dims) for dtype, dims, _ in _arrays(shape))


def hbm_bytes(shape: str) -> int:
    """Bytes of a shape's arrays laid out in HBM: memory space 0, no ``S(n)`` in the layout
    (``S(1)`` is VMEM)."""
    return sum(
        _array_bytes(dtype, dims)
        for dtype, dims, layout in _arrays(shape)
        if not re.search(r"S\((?!0\))\d+\)", layout)
    )


def largest_array_bytes(shape: str) -> int:
    """Bytes of a shape's largest array (an asynchronous collective's ``-start`` op returns
    its operand and its result as a tuple: the result is the larger)."""
    return max((_array_bytes(dtype, dims) for dtype, dims, _ in _arrays(shape)), default=0)


def tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape (the shape itself when it is no tuple)."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    return _split_top(shape[1 : _match(shape, 0)])


def _layout_parts(layout: str) -> tuple[str, str]:
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
        detail=_detail(opcode, attributes),
        computation=computation,
        attributes=attributes,
    )


def _callees(attributes: str) -> list[str]:
    out = []
    for m in _CALLS_RE.finditer(attributes):
        out += [n.strip().lstrip("%") for n in m["names"].split(",")]
    return out


def _detail(opcode: str, attributes: str) -> str:
    if opcode == "custom-call":
        m = _TARGET_RE.search(attributes)
        return m["target"] if m else ""
    if opcode == "fusion":
        kind = _KIND_RE.search(attributes)
        calls = _callees(attributes)
        return " ".join(
            [*([f"kind={kind['kind']}"] if kind else []), *(f"calls=%{c}" for c in calls)]
        )
    for key in ("dimensions", "padding", "slice"):
        m = re.search(rf"\b{key}=(\{{[^}}]*\}}|\S+?)(?:,|$)", attributes)
        if m:
            return f"{key}={m.group(1)}"
    return ""


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
        if line.strip() == "}":
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


def _entry(comps: dict[str, Computation]) -> Computation:
    for comp in comps.values():
        if comp.entry:
            return comp
    raise ValueError("no ENTRY computation in the HLO text")


def parse_entry(text: str) -> list[HloOp]:
    """The ENTRY computation's instructions, in order."""
    return list(_entry(parse_computations(text)).ops)


# --------------------------------------------------------------------------------------------
# Copy trap


def _copy_direction(src_shape: str, dst_shape: str) -> tuple[bool | None, str]:
    """(relayout?, description) of a copy from ``src_shape`` to ``dst_shape``."""
    src, dst = _arrays(src_shape), _arrays(dst_shape)
    if len(src) != 1 or len(dst) != 1:
        return None, ""
    (_, sdims, slayout), (_, ddims, dlayout) = src[0], dst[0]
    sl, ss = _layout_parts(slayout)
    dl, ds = _layout_parts(dlayout)
    parts = []
    relayout = sdims != ddims or sl != dl
    if relayout:
        parts.append(f"relayout {{{sl}}} -> {{{dl}}}")
    if ss != ds:
        parts.append(f"memory space S({ss}) -> S({ds})")
    return relayout, ", ".join(parts) or "same layout and memory space"


def _inner_copies(
    comps: dict[str, Computation], name: str, seen: set[str] | None = None
) -> list[tuple[HloOp, Computation]]:
    """Copy/transpose/pad ops in a called computation and the computations it calls."""
    seen = set() if seen is None else seen
    comp = comps.get(name)
    if comp is None or name in seen:
        return []
    seen.add(name)
    found = []
    for op in comp.ops:
        if op.opcode in _INNER_COPY_OPCODES:
            found.append((op, comp))
        for callee in _callees(op.attributes):
            found += _inner_copies(comps, callee, seen)
    return found


def relayout_copies(text: str) -> list[dict[str, object]]:
    """The copies of `find_copy_trap` that change a layout (not the moves into VMEM, which are
    prefetches), as a results file lists them: name, opcode, shape, bytes and detail."""
    return [
        dict(name=op.name, opcode=op.opcode, shape=op.shape, bytes=op.bytes, detail=op.detail)
        for op in find_copy_trap(text)
        if op.relayout is not False
    ]


def find_copy_trap(text: str) -> list[HloOp]:
    """ENTRY ops that copy or re-lay-out data, in program order.

    Reported: ``copy``, ``copy-start`` (with its ``copy-done``, counted once by the bytes of the
    copied data, not of the start's tuple), ``transpose``, ``pad``, and ops calling computations
    (fusions, calls) that contain ``copy``/``transpose``/``pad``, with ``detail`` naming the inner
    ops. ``relayout`` is False for pure memory-space moves (e.g. cross-program prefetches into
    VMEM), True when the data changes layout/tiling (or a transpose/pad/fusion moves it), None
    when undecidable.
    """
    comps = parse_computations(text)
    entry = _entry(comps)
    shapes = {op.name: op.shape for op in entry.ops}
    starts = {op.name for op in entry.ops if op.opcode == "copy-start"}
    done_of = {
        op.operands[0]: op.name
        for op in entry.ops
        if op.opcode == "copy-done" and op.operands and op.operands[0] in starts
    }
    found: list[HloOp] = []
    for op in entry.ops:
        if op.opcode == "copy-done" and op.operands and op.operands[0] in starts:
            continue  # counted with its copy-start
        if op.opcode == "copy-start":
            elements = tuple_elements(op.shape)
            data = elements[0]
            src = shapes.get(op.operands[0], "") if op.operands else ""
            relayout, how = _copy_direction(src or (elements[1] if len(elements) > 1 else ""), data)
            done = done_of.get(op.name)
            extra = [how] if how else []
            if done:
                extra.append(f"async pair with %{done}")
            if "cross_program_prefetch" in op.attributes:
                extra.append("cross-program prefetch")
            found.append(
                dataclasses.replace(
                    op,
                    shape=data,
                    bytes=shape_bytes(data),
                    detail="; ".join(extra),
                    relayout=relayout,
                )
            )
        elif op.opcode in ("copy", "copy-done"):
            src = shapes.get(op.operands[0], "") if op.operands else ""
            relayout, how = _copy_direction(src, op.shape)
            found.append(dataclasses.replace(op, detail=how, relayout=relayout))
        elif op.opcode in ("transpose", "pad"):
            found.append(dataclasses.replace(op, relayout=True))
        else:
            inner = [x for callee in _callees(op.attributes) for x in _inner_copies(comps, callee)]
            if not inner:
                continue
            descr = []
            relayout: bool | None = False
            for iop, icomp in inner:
                if iop.opcode == "copy":
                    src = icomp.get(iop.operands[0]) if iop.operands else None
                    r, how = _copy_direction(src.shape if src else "", iop.shape)
                    relayout = True if r else (relayout if r is not None else None)
                    descr.append(f"copy %{iop.name}" + (f" ({how})" if how else ""))
                else:
                    relayout = True
                    descr.append(f"{iop.opcode} %{iop.name}")
            head = f"{op.detail}: " if op.detail else ""
            found.append(dataclasses.replace(op, detail=head + "; ".join(descr), relayout=relayout))
    return found


# --------------------------------------------------------------------------------------------
# Kernel calls


def kernel_calls(text: str) -> list[HloOp]:
    """Mosaic (Pallas) kernel calls: custom-calls with ``custom_call_target="tpu_custom_call"``.

    Those of the ENTRY computation come first, in program order, then any inside other
    computations (e.g. a while-loop body, which runs them once per iteration).
    """
    comps = parse_computations(text)
    ordered = sorted(comps.values(), key=lambda c: not c.entry)
    return [op for comp in ordered for op in comp.ops if is_kernel_call(op)]


def is_kernel_call(op: HloOp) -> bool:
    """Whether ``op`` calls a Mosaic (Pallas) kernel."""
    return op.opcode == "custom-call" and op.detail == "tpu_custom_call"


BRANCHES_RE = re.compile(
    r"\b(?:branch_computations=\{(?P<names>[^}]*)\}|(?:true|false)_computation=(?P<one>%[\w.\-]+))"
)


def conditional_kernel_calls(text: str) -> set[str]:
    """Names of the Mosaic kernel calls that sit in a ``conditional``'s branch: they run only
    when the program takes that branch, which a static schedule cannot tell."""
    comps = parse_computations(text)
    branches = {
        name.strip().lstrip("%")
        for comp in comps.values()
        for op in comp.ops
        if op.opcode == "conditional"
        for match in BRANCHES_RE.finditer(op.attributes)
        for name in (match["names"] or match["one"]).split(",")
    }
    return {op.name for op in kernel_calls(text) if op.computation in branches}


_BOOKKEEPING_OPCODES = frozenset({"parameter", "bitcast", "tuple", "get-tuple-element"})


def _only_moves_data(comps: dict[str, Computation], name: str) -> bool:
    """Whether a called computation does nothing but copy or transpose (a relayout fusion)."""
    comp = comps.get(name)
    if comp is None:
        return False
    work = [op for op in comp.ops if op.opcode not in _BOOKKEEPING_OPCODES]
    return bool(work) and all(op.opcode in ("copy", "transpose") for op in work)


def kernel_operand_copies(text: str) -> list[tuple[HloOp, HloOp]]:
    """``(kernel call, producer)`` for each operand of a Mosaic kernel call, in any computation
    (a scanned layer's while body included), that an op makes only by copying data: a
    ``copy`` or ``transpose``, a ``copy-done`` that re-lays the data out, or a fusion of
    nothing but copies and transposes, seen through ``bitcast``s (newer XLA transposes by a
    copy into the transposed layout and a bitcast to the kernel's shape). Memory-space moves
    (prefetches into VMEM) and ops that compute their output (a fused RoPE producing q) are
    not reported."""
    comps = parse_computations(text)
    found = []
    for comp in comps.values():
        ops = {op.name: op for op in comp.ops}
        for call in comp.ops:
            if call.opcode != "custom-call" or call.detail != "tpu_custom_call":
                continue
            for operand in call.operands:
                producer = ops.get(operand)
                while producer is not None and producer.opcode == "bitcast" and producer.operands:
                    producer = ops.get(producer.operands[0])  # a bitcast moves no data
                if producer is None:
                    continue
                if producer.opcode in ("copy", "copy-done"):
                    source = ops.get(producer.operands[0]) if producer.operands else None
                    if producer.opcode == "copy-done" and source is not None:
                        source = ops.get(source.operands[0]) if source.operands else None
                    relayout, _ = _copy_direction(source.shape if source else "", producer.shape)
                    copies = relayout is not False
                elif producer.opcode == "transpose":
                    copies = True
                else:
                    callees = _callees(producer.attributes)
                    copies = bool(callees) and all(_only_moves_data(comps, c) for c in callees)
                if copies:
                    found.append((call, producer))
    return found


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""Opcodes of the ops that move data between devices (asynchronous ones end in ``-start``)."""


def is_collective(op: HloOp) -> bool:
    """Whether ``op`` is a collective op itself (synchronous, or the ``-start`` of a pair)."""
    return op.opcode.removesuffix("-start") in COLLECTIVES


def collectives(text: str) -> list[HloOp]:
    """The ops of every computation that move data between devices, in program order; an
    asynchronous pair counts once, as its ``-start`` op."""
    return [
        op for comp in parse_computations(text).values() for op in comp.ops if is_collective(op)
    ]


def kernel_body(op: HloOp) -> str | None:
    """A Mosaic kernel call's serialized kernel (its ``custom_call_config`` ``body``): two
    calls run one compiled program only if theirs are equal. None for any other op."""
    if not is_kernel_call(op):
        return None
    m = re.search(r'"body"\s*:\s*"(?P<body>[^"]*)"', op.attributes)
    return m["body"] if m else None


def cost_estimate(op: HloOp) -> dict[str, int] | None:
    """The kernel's ``cost_estimate`` (flops, transcendentals, bytes_accessed, ...) if declared."""
    m = re.search(r'"cost_estimate"\s*:\s*(\{[^{}]*\})', op.attributes)
    if m is None:
        return None
    try:
        raw = json.loads(m.group(1))
    except ValueError:
        return None
    out = {}
    for k, v in raw.items():
        try:
            out[k] = int(v)
        except (TypeError, ValueError):
            continue
    return out
