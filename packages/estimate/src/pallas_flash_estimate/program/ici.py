"""The interconnect model: how long a whole program's collectives take on a slice's ICI torus.

Collectives are not scheduled statically (their waits on other chips have no static length),
so their time is modelled from what the compiled HLO says each one moves
(`program_loops.collective_groups`) and the target's topology (`targets.Target`):

- **Traffic.** Each chip of a group of ``g`` sends, for a result of ``R`` bytes: all-gather
  ``R (g-1)/g``; reduce-scatter ``R (g-1)`` (its operand is ``g R``); all-reduce
  ``2 R (g-1)/g`` (a reduce-scatter then an all-gather); all-to-all ``R (g-1)/g``;
  collective-permute ``R``. These are the bandwidth-optimal ring algorithms' figures. XLA's
  all-reduce-scatter fusion (an all-reduce of ``R`` bytes of which each chip keeps its slice:
  FSDP's gradient reduction) runs as a reduce-scatter: ``R (g-1)/g``.
- **Bandwidth.** A group of up to the longer torus side lies along one dimension, a larger
  one along two. A ring along a dimension runs both ways round it when the dimension wraps
  around (two links' bandwidth in each direction), else one; the group's bandwidth is the sum
  over its dimensions of ``ici_link_bandwidth`` times that. v5e slices wrap only at the full
  16x16 pod.
- **Latency.** ``collective_latency`` per collective (an assumption: synchronisation and
  launch) plus ``ici_hop_latency`` per ring step: ``g - 1`` steps along one dimension, the
  sides' ``(a - 1) + (b - 1)`` for a group over two.

A program's step time is reported at both ends of the collectives' overlap with the compute,
all of it hidden and none of it (`step_bounds`), and as the compiled schedule overlaps them
(`overlap`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

from pallas_flash_estimate.read.hlo import HloOp, largest_array_bytes
from pallas_flash_estimate.targets import Target

_MESH_GROUPS_RE = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<used>[^}]*)\}")
_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[(?P<groups>\d+),(?P<size>\d+)\]<=")
_LIST_GROUPS_RE = re.compile(r"replica_groups=\{\{(?P<first>[\d,\s]*)\}")
_PAIRS_RE = re.compile(r"source_target_pairs=")

TRAFFIC = {
    "all-gather": lambda g: (g - 1) / g,
    "reduce-scatter": lambda g: g - 1.0,
    "all-reduce": lambda g: 2 * (g - 1) / g,
    "all-reduce-scatter": lambda g: (g - 1) / g,  # per byte of the all-reduce, before slicing
    "all-to-all": lambda g: (g - 1) / g,
    "collective-permute": lambda g: 1.0,
}
"""Bytes each chip sends per byte of a collective's result, for a group of ``g`` chips."""


def group_size(op: HloOp, chips: int) -> int:
    """How many chips one group of a collective spans (all ``chips`` when the HLO does not
    say: ``replica_groups={}``)."""
    if _PAIRS_RE.search(op.attributes):
        return 2
    mesh = _MESH_GROUPS_RE.search(op.attributes)
    if mesh is not None:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh["axes"]))
        used = re.findall(r"'(\w+)'", mesh["used"])
        return math.prod(int(sizes[a]) for a in used if a in sizes) or 1
    iota = _IOTA_GROUPS_RE.search(op.attributes)
    if iota is not None:
        return int(iota["size"])
    listed = _LIST_GROUPS_RE.search(op.attributes)
    if listed is not None and listed["first"].strip():
        return len(listed["first"].split(","))
    return chips


def _dimensions(group: int, target: Target) -> list[int]:
    """The torus sides a group of ``group`` chips spans (one side, or two)."""
    sides = sorted(target.torus, reverse=True)
    if group <= sides[0]:
        return [group]
    return [sides[0], math.ceil(group / sides[0])]


def collective_seconds(opcode: str, result_bytes: int, group: int, target: Target) -> float:
    """Modelled seconds of one collective (see the module docstring); 0 for a group of one."""
    if group <= 1:
        return 0.0
    sides = _dimensions(group, target)
    ways = 2 if target.ici_wraparound else 1
    bandwidth = target.ici_link_bandwidth * ways * len(sides)
    traffic = TRAFFIC.get(opcode, TRAFFIC["all-gather"])(group) * result_bytes
    steps = sum(side - 1 for side in sides)
    return target.collective_latency + steps * target.ici_hop_latency + traffic / bandwidth


def collective_entry(op: HloOp, chips: int) -> dict:
    """What the model needs of one collective op of a program on ``chips`` chips: its name,
    opcode (an asynchronous pair's, without ``-start``), result bytes and group size."""
    opcode = op.opcode.removesuffix("-start")
    size = largest_array_bytes(op.shape) if op.opcode.endswith("-start") else op.bytes
    return {"name": op.name, "opcode": opcode, "bytes": size, "group": group_size(op, chips)}


def entries_seconds(entries: Iterable[Mapping], target: Target) -> float:
    """Modelled seconds of collectives given as `collective_entry` dicts, run one after
    another, once each."""
    return sum(collective_seconds(e["opcode"], e["bytes"], e["group"], target) for e in entries)


def program_collectives(
    collectives: Iterable[tuple[HloOp, int]], chips: int, target: Target
) -> list[dict]:
    """One entry per collective of a program, ``(op, runs)`` each (the values of
    `program_loops.collective_groups`): its `collective_entry`, runs and modelled seconds
    over all its runs."""
    out = []
    for op, runs in collectives:
        entry = collective_entry(op, chips)
        seconds = collective_seconds(entry["opcode"], entry["bytes"], entry["group"], target)
        out.append({**entry, "runs": runs, "seconds": seconds * runs})
    return out


def step_bounds(compute_seconds: float, collective_seconds: float) -> tuple[float, float]:
    """A step's time with its collectives wholly hidden under its compute, and with none of
    them hidden: ``(max(compute, collectives), compute + collectives)``."""
    return max(compute_seconds, collective_seconds), compute_seconds + collective_seconds
