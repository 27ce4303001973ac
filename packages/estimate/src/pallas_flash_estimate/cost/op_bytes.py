"""What one op of a compiled program moves through HBM: the floor under its static time.

An op's operands and result that lie in HBM (no ``S(n)`` memory space in their layout) are
read or written once, except where the op touches only part of them:

- a fusion parameter used only by ``slice``, ``dynamic-slice`` or ``gather`` ops reads their
  results' bytes, not the whole array (a decode step reads one token's row of the cache);
- a buffer updated in place, the first operand of a ``dynamic-update-slice`` (a fusion's root
  or the op itself), is neither read nor rewritten: only the update's bytes are written; a
  Pallas kernel that updates an operand in place (its output aliases it) moves what its
  ``cost_estimate`` declares, the only count of what its own copies touch;
- a top-level ``slice`` or ``dynamic-slice`` reads and writes its result's bytes;
- an asynchronous copy or slice (``copy-start``, ``slice-start``: a prefetch into VMEM or a
  write back) moves its destination's bytes once, HBM being one side of it.

No JAX import: this module only reads HLO text (`read.hlo`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pallas_flash_estimate.read.hlo import (
    Computation,
    HloOp,
    fused_computation,
    hbm_bytes,
    shape_bytes,
    tuple_elements,
)
from pallas_flash_estimate.read.hlo_ops import cost_estimate, is_kernel_call

_PARAMETER_INDEX_RE = re.compile(r"^param_(?P<index>\d+)")
_PARTIAL_READS = ("slice", "dynamic-slice", "gather")
_UPDATE = "dynamic-update-slice"
_ASYNC_MOVES = ("copy-start", "slice-start")
_ALIASED = "output_to_operand_aliasing"


def _users(comp: Computation) -> dict[str, list[HloOp]]:
    users: dict[str, list[HloOp]] = {}
    for op in comp.ops:
        for name in op.operands:
            users.setdefault(name, []).append(op)
    return users


def _updated_in_place(comp: Computation) -> list[HloOp]:
    """The fusion's root ``dynamic-update-slice`` ops (the root itself or a tuple's)."""
    root = comp.root
    if root is None:
        return []
    if root.opcode == _UPDATE:
        return [root]
    if root.opcode == "tuple":
        ops = {op.name: op for op in comp.ops}
        return [ops[n] for n in root.operands if n in ops and ops[n].opcode == _UPDATE]
    return []


def _fusion_bytes(op: HloOp, fused: Computation, shapes: Mapping[str, str]) -> int:
    users = _users(fused)
    in_place = _updated_in_place(fused)
    buffers = {update.operands[0] for update in in_place if update.operands}
    total = hbm_bytes(op.shape)
    if in_place and total:  # the updated buffers are not rewritten, only their updates
        updates = [u for u in in_place if len(u.operands) > 1]
        total = max(total - sum(hbm_bytes(u.shape) for u in in_place), 0)
        total += sum(hbm_bytes(shapes.get(u.operands[1], "")) for u in updates)
    for param in (p for p in fused.ops if p.opcode == "parameter"):
        match = _PARAMETER_INDEX_RE.match(param.name)
        if match is None or int(match["index"]) >= len(op.operands):
            continue
        outer = shapes.get(op.operands[int(match["index"])], "")
        if not hbm_bytes(outer):  # in VMEM or SMEM
            continue
        readers = users.get(param.name, [])
        if param.name in buffers and all(r.opcode == _UPDATE for r in readers):
            continue
        if readers and all(r.opcode in _PARTIAL_READS and r.operands[0] == param.name
                           for r in readers):  # fmt: skip
            total += sum(hbm_bytes(r.shape) for r in readers)
        else:
            total += hbm_bytes(outer)
    return total


def op_hbm_bytes(op: HloOp, comps: Mapping[str, Computation], shapes: Mapping[str, str]) -> int:
    """Bytes ``op`` reads from and writes to HBM (see the module docstring); ``shapes``: every
    op's result shape by name (its operands' shapes)."""
    if op.opcode == "fusion":
        fused = fused_computation(op, comps)
        if fused is not None:
            return _fusion_bytes(op, fused, shapes)
    if op.opcode == _UPDATE and len(op.operands) > 1:
        return 2 * hbm_bytes(shapes.get(op.operands[1], ""))
    if op.opcode in ("slice", "dynamic-slice"):
        return 2 * hbm_bytes(op.shape)
    if op.opcode in _ASYNC_MOVES:
        parts = tuple_elements(op.shape)
        return shape_bytes(parts[1]) if len(parts) > 1 else shape_bytes(op.shape)
    declared = cost_estimate(op) if is_kernel_call(op) else None
    if declared and "bytes_accessed" in declared and _ALIASED in op.attributes:
        return declared["bytes_accessed"]
    return sum(hbm_bytes(s) for s in (op.shape, *(shapes.get(n, "") for n in op.operands)))
