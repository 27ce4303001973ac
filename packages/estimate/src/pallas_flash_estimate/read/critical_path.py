"""The compiler's latency model of a kernel: its ``...-critical-path.txt`` dump.

libtpu writes, per LLO program and before the final schedule, the critical path of every basic
block (the instructions on it, each with its "Length to end" in cycles)::

    New basic block in region: region47 {members=54016 hlo=pallas_flash_forward.1 parent=31}
      Length to end: 16882, %v153320 = vld [vmem:[%s306 + $0xb8] sm:$0xf]
      Length to end: 16879, %1312 = vmatpush.bf16.xpose.msra.mxu2 %v153321
      ...

A region's blocks come in program order (a region split by its child regions lists one block
per piece). The region numbers are those of the final bundles' ``Start region N`` / ``End
region N`` comments, so each block's length can be charged to the bundles of its region and
weighed per grid step like the bundles themselves (`llo.executed_weight`): the sum is the
kernel's time if every basic block ran at its dependency-bound length, whatever the issue
slots. The model charges a bf16 ``vmatmul`` 16 cycles and a ``vmatpush`` 8, and keeps pushes
for the next weight tile (``msra`` / ``msrb`` staging) off the path where they overlap matmuls.

No JAX import: this module only reads text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

__all__ = ["Block", "bundle_weights", "parse_critical_path", "region_spans"]

_BLOCK_RE = re.compile(
    r"^New basic block in region: region(?P<region>\d+) \{members=(?P<members>\d+)"
    r".*?parent=(?P<parent>-?\d+)\}"
)
_LENGTH_RE = re.compile(r"^\s*Length to end: (?P<length>\d+),")
_MARK_RE = re.compile(r"(Start/End empty|Start|End) region (\d+)")
_ENTRY_REGION = 0  # the program's entry block: no region comment in the bundles


@dataclasses.dataclass(frozen=True)
class Block:
    """One basic block's critical path."""

    region: int
    parent: int
    members: int  # instructions in the block
    length: int  # cycles from its first instruction to its end (0 when none are listed)


def parse_critical_path(text: str) -> tuple[Block, ...]:
    """The basic blocks of a ``critical-path`` dump, in file order."""
    blocks: list[Block] = []
    for line in text.splitlines():
        if m := _BLOCK_RE.match(line):
            blocks.append(Block(int(m["region"]), int(m["parent"]), int(m["members"]), 0))
        elif blocks and (m := _LENGTH_RE.match(line)):
            last = blocks[-1]
            blocks[-1] = dataclasses.replace(last, length=max(last.length, int(m["length"])))
    return tuple(blocks)


def region_spans(comments: Sequence[str]) -> dict[int, tuple[int, int]]:
    """``region -> (first, last bundle)`` from the bundles' trailing comments."""
    starts: dict[int, int] = {}
    spans: dict[int, tuple[int, int]] = {}
    for index, comment in enumerate(comments):
        for kind, number in _MARK_RE.findall(comment):
            region = int(number)
            if kind == "Start":
                starts.setdefault(region, index)
            elif kind == "End" and region in starts:
                spans.setdefault(region, (starts[region], index))
            elif kind == "Start/End empty":
                spans.setdefault(region, (index, index))
    return spans


def bundle_weights(blocks: Sequence[Block], comments: Sequence[str]) -> tuple[list[int], list[str]]:
    """Per bundle, the critical-path cycles charged to it, and warnings.

    A region's blocks are charged to its last bundle outside every region nested in it (its
    own code, which runs whenever the region does: the scheduler may hoist a region's first
    instructions above the branch that skips it, never its last below the branch's target), or
    its first bundle when it has none; the entry block and regions absent from the bundles to
    bundle 0 (run once).
    """
    spans = region_spans(comments)
    weights = [0] * len(comments)
    warnings: list[str] = []
    for block in blocks:
        if not block.length:
            continue
        span = spans.get(block.region)
        if span is None:
            if block.region != _ENTRY_REGION:
                warnings.append(
                    f"critical path of region {block.region} ({block.length} cycles) has no "
                    "bundles: counted once"
                )
            weights[0] += block.length
            continue
        weights[_own_bundle(block.region, span, spans)] += block.length
    return weights, warnings


def _own_bundle(region: int, span: tuple[int, int], spans: dict[int, tuple[int, int]]) -> int:
    first, last = span
    nested = [
        s for r, s in spans.items() if r != region and first <= s[0] <= s[1] <= last and s != span
    ]
    at = last
    while at > first and any(s <= at <= e for s, e in nested):
        at -= 1
    return at
