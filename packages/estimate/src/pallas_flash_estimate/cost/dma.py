"""The HBM traffic of a kernel, from the DMA instructions of its final bundles.

A Pallas kernel streams its blocks with ``dma.hbm_to_vmem`` (inputs) and ``dma.vmem_to_hbm``
(outputs), each carrying its descriptor in a comment::

    %8254 = dma.hbm_to_vmem [thread:$0]  (!%p9628_p13), /*hbm=*/%s257_s8, ... /*
    base_bounds: (1, 4, 256, 1)  window_bounds: (1, 1, 64, 1)  iteration_bounds: (1, 4, 4, 4)
    ...  element_size_in_bytes: 2048 */

One transfer moves ``prod(window_bounds) x element_size_in_bytes`` bytes (here 64 x 2048 =
128 KiB: a 512 x 128 bf16 block, the BlockSpec's block). Its predicate (``!%p9628_p13``) skips
the copy when the block index did not change from the previous grid step; it is evaluated per
grid step like the predicated regions (`llo.executed_instruction`), so a block fetched once per
row of the grid counts once per row.

A strided block (several runs of the array in one transfer, e.g. ``[kv_heads, block, head_dim]``
of a ``[batch, kv_heads, length, head_dim]`` cache) is a ``dma.general`` instead, whose size is
``size_in_granules`` of 32 bytes (checked: a ``[8, 256, 128]`` bf16 block, 512 KiB, is 16384
granules) and whose comment gives no direction; in a Pallas kernel's pipeline one side is HBM.
Copies into SMEM (``dma.hbm_to_smem``: scalar tables such as splash attention's block masks, a
few bytes) are left out.
"""

from __future__ import annotations

import dataclasses
import math
import re

from pallas_flash_estimate.cost import llo
from pallas_flash_estimate.evaluate import bundle_listing, loop_trips

__all__ = ["Transfer", "executed_bytes", "transfers"]

_HBM_VMEM_RE = re.compile(r"\.(hbm_to_vmem|vmem_to_hbm|general)\b")
GRANULE_BYTES = 32
_GUARD_RE = re.compile(r"\(\s*(?P<guard>!?%p\w+)\s*\)")
_WINDOW_RE = re.compile(r"window_bounds:\s*\(([\d,\s]*)\)")
_ELEMENT_RE = re.compile(r"element_size_in_bytes:\s*(\d+)")


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One DMA instruction between HBM and VMEM."""

    bundle: int  # bundle index
    opcode: str  # "dma.hbm_to_vmem", "dma.vmem_to_hbm"
    bytes: int | None  # bytes per transfer; None without a descriptor
    guard: str | None  # "%p3" / "!%p3": runs only when it holds

    @property
    def into_vmem(self) -> bool:
        return self.opcode.endswith("to_vmem")


def transfers(
    listing: bundle_listing.BundleListing, granules: bool = False
) -> tuple[Transfer, ...]:
    """The HBM<->VMEM DMA instructions of a listing, in bundle order; with ``granules``, one
    without a block descriptor sized by its ``size_in_granules`` operand."""
    found = []
    for b in listing.bundles:
        for ins in b.instructions:
            if ins.base != "dma" or not _HBM_VMEM_RE.search(ins.opcode):
                continue
            if ins.opcode.endswith(".general"):
                found.append(Transfer(b.index, ins.opcode, _general_bytes(ins), ins.guard))
                continue
            guard = _GUARD_RE.match(ins.args.partition("]")[2].strip())
            window, element = _WINDOW_RE.search(ins.note), _ELEMENT_RE.search(ins.note)
            size = None
            if window and element:
                dims = [int(x) for x in window[1].replace(" ", "").split(",") if x]
                size = math.prod(dims) * int(element[1])
            elif granules:  # a manual copy (make_async_copy): no block descriptor
                size = _general_bytes(ins)
            found.append(Transfer(b.index, ins.opcode, size, guard["guard"] if guard else None))
    return tuple(found)


def _general_bytes(ins: bundle_listing.Instruction) -> int | None:
    """Bytes of a ``dma.general``: its operands are named in its note (``src= ::
    size_in_granules= :: dst= ...``), in order."""
    names = [name.strip() for name in ins.note.split("::")]
    values = [value.strip() for value in ins.args.split(",")]
    if "size_in_granules=" not in names:
        return None
    granules = values[names.index("size_in_granules=")]
    return int(granules) * GRANULE_BYTES if granules.isdigit() else None


def executed_bytes(
    listing: bundle_listing.BundleListing, counts: loop_trips.BundleCounts | None = None
) -> tuple[int, int] | None:
    """(min, max) HBM bytes the kernel's DMAs move over all its grid steps, predicates undecided
    from the schedule taken as false (min) or true (max); None when a transfer has no
    descriptor or sits in a loop whose iterations are not evaluated.

    With ``counts`` (`loop_trips.bundle_counts`: loops with trip counts from the workload) each
    transfer runs as often as its bundle, and a copy of a manual DMA (``make_async_copy``, no
    block descriptor) moves its ``size_in_granules``."""
    lo = hi = 0
    for t in transfers(listing, granules=counts is not None):
        if counts is not None:
            runs = loop_trips.instruction_runs(counts, t.bundle, t.guard)
        else:
            runs = llo.executed_instruction(listing, t.bundle, t.guard)
        if runs is None or t.bytes is None:
            return None
        lo += runs[0] * t.bytes
        hi += runs[1] * t.bytes
    return lo, hi
