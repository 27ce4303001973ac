"""Derived figures: cycles from the static schedule, the roofline, MFU, tokens/s, tokens/$.

Every figure is ``{"value": float | None, "source": ...}``: ``static`` (the compiler's VLIW
schedule), ``model`` (roofline arithmetic), ``compiler`` (its memory or cost analysis),
``measured-cpu`` or ``measured-tpu`` (wall clock).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Protocol

from pallas_flash_bench.targets import Target
from pallas_flash_bench.workloads import Workload

Figure = dict[str, object]


class Occupancy(Protocol):
    """What the estimator needs to know of a kernel call beyond its listing: whether a causal
    mask skips blocks (``causal``), and, for a decode (``op == "decode"``) of ragged
    ``lengths``, which blocks hold cached tokens (`Workload` is one)."""

    @property
    def causal(self) -> bool: ...
    @property
    def op(self) -> str: ...
    @property
    def lengths(self) -> tuple[int, int] | None: ...


@dataclasses.dataclass(frozen=True)
class FullGrid:
    """The occupancy of a kernel the estimator knows nothing about (any user's kernel): no
    mask skips a block, every region the schedule cannot decide runs on every grid step, and
    every block it copies is read. ``loop_trips``: for a kernel whose loops' trip counts
    read memory (a grid sized at run time), how often each runs over the whole kernel,
    outermost first (`spread.kernel_entry`); None: each runs once."""

    causal: bool = False
    op: str = "kernel"
    lengths: None = None
    loop_trips: tuple[int, ...] | None = None


FULL_GRID = FullGrid()


def figure(value: float | None, source: str) -> Figure:
    return {"value": value, "source": source}


def causal_active_fraction(q_blocks: int, kv_blocks: int) -> float:
    """Fraction of a ``q_blocks x kv_blocks`` grid over a square causal mask that holds at least
    one visible score: block ``(i, j)`` is active iff ``j / kv_blocks < (i + 1) / q_blocks``."""
    active = sum(
        1 for i in range(q_blocks) for j in range(kv_blocks) if j * q_blocks < (i + 1) * kv_blocks
    )
    return active / (q_blocks * kv_blocks)


def undecided_fraction(
    grid: tuple[int, ...] | None, causal: bool, workload: Occupancy | None = None
) -> float:
    """Fraction of the grid steps taken to run a region the schedule cannot decide (its
    predicate reads memory, like splash attention's block mask): the steps a causal mask
    leaves active; for a decode ``workload`` of ragged lengths whose grid leads with the batch
    and ends with each sequence's blocks, the blocks that hold a cached token
    (`Workload.active_fraction`); all of them otherwise."""
    if causal and grid is not None and len(grid) >= 2:
        return causal_active_fraction(grid[-2], grid[-1])
    ragged = workload is not None and workload.op == "decode" and workload.lengths is not None
    if ragged and grid is not None and len(grid) >= 2 and workload.batch in grid[:2]:
        return workload.active_fraction(grid[-1])  # jax-paged: (cores, batch, heads, blocks)
    return 1.0


PAGE_COPYING_KERNELS = {
    "pallas_flash_split_kv_decode_paged": None,
    "pallas_flash_split_kv_decode_contiguous_pages": 128,
}
"""Decode kernels (splitkv's ``paged_kernel``) that copy each block by the page, only the
pages that hold a token, by name: the positions of a contiguous cache's page (None: a paged
cache's own pages)."""


def copied_fraction(name: str, grid: tuple[int, ...] | None, workload: Occupancy | None) -> float:
    """Fraction of its operands' bytes the kernel ``name`` reads: a page-copying decode kernel
    (`PAGE_COPYING_KERNELS`) of ragged lengths, the pages that hold a token
    (`Workload.copied_fraction`); any other, the whole blocks a ragged decode's lengths fill
    (`undecided_fraction`, no causal skipping), else all."""
    stem = name.split(".")[0]
    ragged = workload is not None and workload.op == "decode" and workload.lengths is not None
    if ragged and stem in PAGE_COPYING_KERNELS:
        return workload.copied_fraction(PAGE_COPYING_KERNELS[stem] or workload.page_size)
    return undecided_fraction(grid, False, workload)


def between(bounds: tuple[int, int] | None, fraction: float) -> int | None:
    """``min + fraction x (max - min)`` of a (regions skipped, regions run) pair, rounded up."""
    if bounds is None:
        return None
    lo, hi = bounds
    return lo + math.ceil((hi - lo) * fraction)


def kernel_cycles(
    executed_min: int | None,
    executed_max: int | None,
    fallback: int,
    grid: tuple[int, ...] | None,
    causal: bool,
    mxu_min: int | None = None,
    mxu_max: int | None = None,
    workload: Occupancy | None = None,
) -> tuple[int, str]:
    """Headline static cycles of one kernel and how they were obtained.

    One bundle issues per cycle, but a ``vmatmul`` keeps its MXU busy for several cycles
    (`bundle_listing.MXU_ROWS_PER_CYCLE`); the kernel takes the larger of its bundles and its
    busiest MXU's cycles (weight pushes free: see `pallas_flash_bench.spread` for the other
    estimates).

    ``executed_min`` / ``executed_max`` are the bundles the kernel executes with its undecided
    predicated regions skipped / run (equal when the schedule decides every region, e.g. a
    block skip computed from the grid indices), ``mxu_min`` / ``mxu_max`` the busiest MXU's
    cycles likewise. When they differ, the regions run on `undecided_fraction` of the steps.
    Without the bundle figures (inner loops, unknown trip count), ``fallback`` is used: grid
    steps x bundles per step, every region run; for a decode of ragged lengths, only on the
    steps whose block holds a cached token (the others counted free: the kernel's benefit).
    """
    if executed_min is None or executed_max is None:
        fraction = undecided_fraction(grid, False, workload)
        if fraction < 1.0:
            return math.ceil(fallback * fraction), (
                f"grid steps x bundles per step on the {fraction:.0%} of steps whose block "
                "holds a cached token (the others counted free)"
            )
        return fallback, "grid steps x bundles per step"
    fraction = 1.0
    if executed_min == executed_max and mxu_min == mxu_max:
        how = "every predicated region decided"
    else:
        fraction = undecided_fraction(grid, causal, workload)
        how = f"data-dependent regions run on {fraction:.0%} of the steps"
    cycles = between((executed_min, executed_max), fraction)
    assert cycles is not None
    if mxu_min is not None and mxu_max is not None:
        mxu = between((mxu_min, mxu_max), fraction)
        assert mxu is not None
        if mxu > cycles:
            how += f"; MXU-bound: the busiest MXU needs {mxu} cycles for {cycles} bundles"
            cycles = mxu
    return cycles, how


def dma_cycles(dma_bytes: float, target: Target) -> float:
    """Cycles the target's HBM needs to move ``dma_bytes``: a kernel's block copies, to set
    against its compute (both overlap only while the copies hide under the compute)."""
    return dma_bytes / target.hbm_bandwidth * target.clock_hz


def spread(
    workload: Workload,
    target: Target,
    cycles: dict[str, int | None],
    memory_seconds: float,
    collective_seconds: float,
) -> dict[str, dict[str, float | None]]:
    """Per estimate (program cycles, see `pallas_flash_bench.spread`): its cycles, latency
    (compute or memory time, whichever is longer, plus the collectives, as the headline) and
    MFU; None where the estimate is missing."""
    out: dict[str, dict[str, float | None]] = {}
    peak = target.peak_flops * workload.chips
    for name, value in cycles.items():
        if value is None:
            out[name] = {"cycles": None, "latency_seconds": None, "mfu": None}
            continue
        latency = max(value / target.clock_hz, memory_seconds) + collective_seconds
        out[name] = {
            "cycles": value,
            "latency_seconds": latency,
            "mfu": workload.useful_flops / latency / peak,
        }
    return out


RING_TRAFFIC = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0}
"""Bytes each chip sends per byte of a collective's result, times ``chips / (chips - 1)``, on a
ring: an all-reduce is a reduce-scatter and an all-gather. Other collectives: 1."""


def collective_seconds(collectives: Sequence[tuple[str, int]], chips: int, target: Target) -> float:
    """Modelled time of a program's collectives, ``(opcode, result bytes)`` each, on ``chips``
    chips in a ring: per collective, the target's assumed ``collective_latency`` plus its ring
    traffic over one ICI link in one direction (see `pallas_flash_bench.targets`)."""
    share = (chips - 1) / chips
    return sum(
        target.collective_latency
        + RING_TRAFFIC.get(opcode, 1.0) * share * size / target.ici_link_bandwidth
        for opcode, size in collectives
    )


def derive(
    workload: Workload,
    target: Target,
    price_per_chip_hour: float,
    *,
    static_cycles: int | None,
    has_kernels: bool,
    compiler_flops: float | None,
    compiler_bytes: float | None,
    copy_bytes: int,
    collectives: Sequence[tuple[str, int]] = (),
    min_hbm_bytes: float | None = None,
) -> dict[str, Figure]:
    """The row's estimated figures.

    Compute time: the program's static cycles / clock (its Pallas kernels and the XLA ops
    around them, see ``runner.program_cycles``) when known, else the compiler's flop count /
    peak (model). HBM bytes: for programs with Pallas kernels, whose byte count is only their
    own declared estimate, the least the workload must move plus twice the copy-trap bytes
    (read and write) (model); else the compiler's count. Latency is the larger of compute and
    memory time: HBM transfers hidden under compute or the reverse. Without any overlap it
    would be their sum, ``latency_no_overlap_seconds``: the two bracket a kernel whose
    transfers and compute overlap in part, which a static schedule cannot tell.

    A workload on several chips runs one program per chip: its static cycles and copy bytes
    are one chip's, its HBM bytes are read at the pace of the busiest chip
    (`Workload.busiest_chip_share` of them, at one chip's bandwidth), and its collectives
    (`collective_seconds`, model) follow the kernels, so their time adds to the latency.
    Prices, peak FLOP/s and bandwidth are those of all its chips.

    ``min_hbm_bytes``: the least this implementation must move, where it is less than the
    workload's (`Workload.min_hbm_bytes`; e.g. a reference with per-tensor int8 scales).
    """
    useful = workload.useful_flops
    least = workload.min_hbm_bytes if min_hbm_bytes is None else min_hbm_bytes
    chips = workload.chips
    if static_cycles is not None:
        compute = figure(static_cycles / target.clock_hz, "static")
    else:
        compute = figure((compiler_flops or useful) / target.peak_flops / chips, "model")
    if compiler_bytes and not has_kernels:
        hbm_bytes = figure(max(compiler_bytes * chips, least), "compiler")
    else:
        hbm_bytes = figure(least + 2 * copy_bytes * chips, "model")
    share = max(workload.busiest_chip_share, 1.0 / chips)
    memory = figure(hbm_bytes["value"] * share / target.hbm_bandwidth, "model")
    latency = max(compute, memory, key=lambda f: f["value"])
    exchange = figure(collective_seconds(collectives, chips, target), "model")
    if exchange["value"]:
        latency = figure(latency["value"] + exchange["value"], "model")
    no_overlap = figure(compute["value"] + memory["value"] + exchange["value"], "model")
    seconds = latency["value"]
    tokens_per_second = workload.tokens / seconds
    dollars_per_second = price_per_chip_hour * chips / 3600
    return {
        "useful_flops": figure(useful, "model"),
        "hbm_bytes": hbm_bytes,
        "compute_seconds": compute,
        "memory_seconds": memory,
        "collective_seconds": exchange,
        "latency_seconds": latency,
        "latency_no_overlap_seconds": no_overlap,
        "mfu": figure(useful / seconds / (target.peak_flops * chips), latency["source"]),
        "hbm_bandwidth_use": figure(
            hbm_bytes["value"] / seconds / (target.hbm_bandwidth * chips), latency["source"]
        ),
        "tokens_per_second": figure(tokens_per_second, latency["source"]),
        "tokens_per_dollar": figure(tokens_per_second / dollars_per_second, latency["source"]),
    }
