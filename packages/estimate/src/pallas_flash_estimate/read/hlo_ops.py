"""The ops of a compiled program that the estimator and the tests look for, in its optimized
HLO text (`read.hlo` parses it): Mosaic kernel calls and their
configuration, collectives, and the "copy trap", the ops that copy or re-lay-out data around
the kernels.

No JAX import: this module only reads text.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection, Sequence

from pallas_flash_estimate.read import hlo

__all__ = [
    "COLLECTIVES",
    "collectives",
    "conditional_kernel_calls",
    "cost_estimate",
    "find_copy_trap",
    "is_collective",
    "is_kernel_call",
    "kernel_body",
    "kernel_calls",
    "kernel_operand_copies",
    "kernel_twins",
    "relayout_copies",
]

_INNER_COPY_OPCODES = ("copy", "transpose", "pad")
_COPY_OPCODES = ("copy", "copy-start", "copy-done", "transpose", "pad")


def _copy_direction(src_shape: str, dst_shape: str) -> tuple[bool | None, str]:
    """(relayout?, description) of a copy from ``src_shape`` to ``dst_shape``."""
    src, dst = hlo.arrays(src_shape), hlo.arrays(dst_shape)
    if len(src) != 1 or len(dst) != 1:
        return None, ""
    (_, sdims, slayout), (_, ddims, dlayout) = src[0], dst[0]
    sl, ss = hlo.layout_parts(slayout)
    dl, ds = hlo.layout_parts(dlayout)
    parts = []
    relayout = sdims != ddims or sl != dl
    if relayout:
        parts.append(f"relayout {{{sl}}} -> {{{dl}}}")
    if ss != ds:
        parts.append(f"memory space S({ss}) -> S({ds})")
    return relayout, ", ".join(parts) or "same layout and memory space"


def _inner_copies(
    comps: dict[str, hlo.Computation], name: str, seen: set[str] | None = None
) -> list[tuple[hlo.HloOp, hlo.Computation]]:
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
        for callee in hlo.callees(op.attributes):
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


def find_copy_trap(text: str) -> list[hlo.HloOp]:
    """ENTRY ops that copy or re-lay-out data, in program order.

    Reported: ``copy``, ``copy-start`` (with its ``copy-done``, counted once by the bytes of the
    copied data, not of the start's tuple), ``transpose``, ``pad``, and ops calling computations
    (fusions, calls) that contain ``copy``/``transpose``/``pad``, with ``detail`` naming the inner
    ops. ``relayout`` is False for pure memory-space moves (e.g. cross-program prefetches into
    VMEM), True when the data changes layout/tiling (or a transpose/pad/fusion moves it), None
    when undecidable.
    """
    comps = hlo.parse_computations(text)
    entry = hlo.entry_computation(comps)
    shapes = {op.name: op.shape for op in entry.ops}
    starts = {op.name for op in entry.ops if op.opcode == "copy-start"}
    done_of = {
        op.operands[0]: op.name
        for op in entry.ops
        if op.opcode == "copy-done" and op.operands and op.operands[0] in starts
    }
    found: list[hlo.HloOp] = []
    for op in entry.ops:
        if op.opcode == "copy-done" and op.operands and op.operands[0] in starts:
            continue  # counted with its copy-start
        if op.opcode == "copy-start":
            elements = hlo.tuple_elements(op.shape)
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
                    bytes=hlo.shape_bytes(data),
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
            inner = [
                x for callee in hlo.callees(op.attributes) for x in _inner_copies(comps, callee)
            ]
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


def kernel_calls(text: str) -> list[hlo.HloOp]:
    """Mosaic (Pallas) kernel calls: custom-calls with ``custom_call_target="tpu_custom_call"``.

    Those of the ENTRY computation come first, in program order, then any inside other
    computations (e.g. a while-loop body, which runs them once per iteration).
    """
    comps = hlo.parse_computations(text)
    ordered = sorted(comps.values(), key=lambda c: not c.entry)
    return [op for comp in ordered for op in comp.ops if is_kernel_call(op)]


def kernel_twins(calls: Sequence[hlo.HloOp], scheduled: Collection[str]) -> dict[str, str]:
    """The kernel calls (`kernel_calls`) not in ``scheduled`` (those with a schedule in the
    LLO dump) -> a call in it of the very same kernel: the same result shape and the same
    serialized kernel (`kernel_body`). libtpu compiles such twins once and dumps them under one
    name (a layer's K and V cache writes), so both run that one schedule."""

    def key(op: hlo.HloOp) -> tuple[str, str | None]:
        return op.shape, kernel_body(op)

    found = {key(op): op.name for op in calls if op.name in scheduled}
    return {
        op.name: found[key(op)] for op in calls if op.name not in scheduled and key(op) in found
    }


def is_kernel_call(op: hlo.HloOp) -> bool:
    """Whether ``op`` calls a Mosaic (Pallas) kernel."""
    return op.opcode == "custom-call" and op.detail == "tpu_custom_call"


_VALUE_KEEPING = ("bitcast", "copy", "copy-start", "copy-done")
"""Ops between a constant and a kernel that keep a one-dimensional array's values in order."""


def kernel_constant_operands(text: str) -> dict[str, dict[int, int | tuple[int, ...]]]:
    """Per Mosaic kernel call, its operands that are integer constants (`hlo.integer_constant`):
    operand index -> value (an int, or an array's elements in row-major order). A kernel whose
    grid is sized at run time (a block-sparse mask's active blocks) takes the grid's size as
    a scalar operand and the mask's block tables as arrays, which its loops compare their
    counters with and read; in the compiled program they are often constants, moved into
    VMEM first (``copy-start``/``copy-done``), which changes no value. Arrays are taken with
    one dimension only, whose words lie in the kernel's memory in that order."""
    found: dict[str, dict[int, int | tuple[int, ...]]] = {}
    for comp in hlo.parse_computations(text).values():
        ops = {op.name: op for op in comp.ops}
        for call in comp.ops:
            if not is_kernel_call(call):
                continue
            values = {}
            for index, operand in enumerate(call.operands):
                op = ops.get(operand)
                while op is not None and op.opcode in _VALUE_KEEPING and op.operands:
                    op = ops.get(op.operands[0])
                value = hlo.integer_constant(op) if op is not None else None
                if isinstance(value, int) or (value and len(hlo.arrays(op.shape)[0][1]) == 1):
                    values[index] = value
            if values:
                found[call.name] = values
    return found


BRANCHES_RE = re.compile(
    r"\b(?:branch_computations=\{(?P<names>[^}]*)\}|(?:true|false)_computation=(?P<one>%[\w.\-]+))"
)


def conditional_kernel_calls(text: str) -> set[str]:
    """Names of the Mosaic kernel calls that sit in a ``conditional``'s branch: they run only
    when the program takes that branch, which a static schedule cannot tell."""
    comps = hlo.parse_computations(text)
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


def _only_moves_data(comps: dict[str, hlo.Computation], name: str) -> bool:
    """Whether a called computation does nothing but copy or transpose (a relayout fusion)."""
    comp = comps.get(name)
    if comp is None:
        return False
    work = [op for op in comp.ops if op.opcode not in _BOOKKEEPING_OPCODES]
    return bool(work) and all(op.opcode in ("copy", "transpose") for op in work)


def kernel_operand_copies(text: str) -> list[tuple[hlo.HloOp, hlo.HloOp]]:
    """``(kernel call, producer)`` for each operand of a Mosaic kernel call, in any computation
    (a scanned layer's while body included), that an op makes only by copying data: a
    ``copy`` or ``transpose``, a ``copy-done`` that re-lays the data out, or a fusion of
    nothing but copies and transposes, seen through ``bitcast``s (newer XLA transposes by a
    copy into the transposed layout and a bitcast to the kernel's shape). Memory-space moves
    (prefetches into VMEM) and ops that compute their output (a fused RoPE producing q) are
    not reported."""
    comps = hlo.parse_computations(text)
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
                    callees = hlo.callees(producer.attributes)
                    copies = bool(callees) and all(_only_moves_data(comps, c) for c in callees)
                if copies:
                    found.append((call, producer))
    return found


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""Opcodes of the ops that move data between devices (asynchronous ones end in ``-start``)."""


def is_collective(op: hlo.HloOp) -> bool:
    """Whether ``op`` is a collective op itself (synchronous, or the ``-start`` of a pair)."""
    return op.opcode.removesuffix("-start") in COLLECTIVES


def collectives(text: str) -> list[hlo.HloOp]:
    """The ops of every computation that move data between devices, in program order; an
    asynchronous pair counts once, as its ``-start`` op."""
    return [
        op for comp in hlo.parse_computations(text).values() for op in comp.ops if is_collective(op)
    ]


def kernel_body(op: hlo.HloOp) -> str | None:
    """A Mosaic kernel call's serialized kernel (its ``custom_call_config`` ``body``): two
    calls run one compiled program only if theirs are equal. None for any other op."""
    if not is_kernel_call(op):
        return None
    m = re.search(r'"body"\s*:\s*"(?P<body>[^"]*)"', op.attributes)
    return m["body"] if m else None


def cost_estimate(op: hlo.HloOp) -> dict[str, int] | None:
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
