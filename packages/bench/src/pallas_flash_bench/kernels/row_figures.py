"""Derived figures of a row: its time from the static schedule's cycles (a kernel's:
`pallas_flash_estimate.cost.kernel_cost`), the roofline, MFU, tokens/s, tokens/$.

Every figure is ``{"value": float | None, "source": ...}``: ``static`` (the compiler's VLIW
schedule), ``model`` (roofline arithmetic), ``compiler`` (its memory or cost analysis),
``measured-cpu`` or ``measured-tpu`` (wall clock).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pallas_flash import page_write_kernel, row_write_kernel
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.cost.spread import ESTIMATES
from pallas_flash_estimate.program import ici
from pallas_flash_estimate.read import hlo
from pallas_flash_estimate.targets import Target

Figure = dict[str, object]


SPREAD = (*ESTIMATES, "dma")
"""The program estimates of a row: the kernel estimates, and ``dma``: per kernel the larger of
its headline cycles and its DMA cycles (`dma_cycles`)."""

RANGE_ESTIMATES = ("critical_path", "push8", "push16", "dma")
"""The estimates that are whole figures like the headline: the schedule alone and the MXU
floor alone are its two parts (each a bound on time only), left out of the MFU range."""


def figure(value: float | None, source: str) -> Figure:
    return {"value": value, "source": source}


def figure_value(row: Mapping, name: str) -> float | None:
    """The value of a row's figure ``name`` (``row["figures"][name]["value"]``); None where
    the row has no such figure or it has no value."""
    entry = (row.get("figures") or {}).get(name)
    value = entry.get("value") if isinstance(entry, Mapping) else None
    return float(value) if isinstance(value, int | float) else None


def dma_cycles(dma_bytes: float, target: Target) -> float:
    """Cycles the target's HBM needs to move ``dma_bytes``: a kernel's block copies, to set
    against its compute (both overlap only while the copies hide under the compute)."""
    return dma_bytes / target.hbm_bandwidth * target.clock_hz


def step_seconds(kernel: dict, target: Target) -> dict[str, float | None]:
    """A kernel's time per grid step: its compute (headline cycles over the clock) and its
    block copies (`dma_cycles`'s bytes over the HBM bandwidth), to set one against the other;
    None where a figure is missing."""
    steps = kernel.get("steps")
    cycles, dma = kernel.get("cycles"), kernel.get("dma_bytes")
    if not steps:
        return {"compute": None, "dma": None}
    return {
        "compute": None if cycles is None else cycles / steps / target.clock_hz,
        "dma": None if dma is None else dma / steps / target.hbm_bandwidth,
    }


def spread(
    workload: Workload,
    target: Target,
    cycles: dict[str, int | None],
    memory_seconds: float,
    collective_seconds: float,
) -> dict[str, dict[str, float | None]]:
    """Per estimate (program cycles, see `pallas_flash_estimate.cost.spread`): its cycles, latency
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


def mfu_range(mfu: float | None, estimates: dict[str, dict[str, float | None]]) -> dict | None:
    """The least and most MFU over the headline (``mfu``) and the whole estimates
    (`RANGE_ESTIMATES`, from `spread`): ``{"low": ..., "high": ...}``; None without any."""
    values = [estimates.get(name, {}).get("mfu") for name in RANGE_ESTIMATES]
    if all(v is None for v in values):
        return None
    known = [v for v in (mfu, *values) if v is not None]
    return {"low": min(known), "high": max(known)}


DECLARING_KERNELS = (
    page_write_kernel.KERNEL_NAME,
    page_write_kernel.SCALES_KERNEL_NAME,
    row_write_kernel.KERNEL_NAME,
)
"""Kernels whose declared cost is the bytes they move (at most): core's cache writes. A program
whose only kernels are these (the xla backend's serving step) keeps the compiler's byte count,
which holds them; any other kernel's declared bytes are its own estimate (`derive`)."""


def has_estimated_kernels(kernels: Sequence[Mapping]) -> bool:
    """Whether a row's kernels (``row["kernels"]``) include one not in `DECLARING_KERNELS`."""
    return any(k["name"].split(".")[0] not in DECLARING_KERNELS for k in kernels)


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
    collectives: Sequence[Mapping] = (),
    min_hbm_bytes: float | None = None,
) -> dict[str, Figure]:
    """The row's estimated figures.

    Compute time: the program's static cycles / clock (its Pallas kernels and the XLA ops
    around them, see ``runner.program_cycles``) when known, else the compiler's flop count /
    peak (model). HBM bytes: for programs with Pallas kernels (``has_kernels``: other than
    `DECLARING_KERNELS`), whose byte count is only their own declared estimate, the least the
    workload must move plus twice the copy-trap bytes (read and write) (model); else the
    compiler's count. Latency is the larger of compute and
    memory time: HBM transfers hidden under compute or the reverse. Without any overlap it
    would be their sum, ``latency_no_overlap_seconds``: the two bracket a kernel whose
    transfers and compute overlap in part, which a static schedule cannot tell.

    A workload on several chips runs one program per chip: its static cycles and copy bytes
    are one chip's, its HBM bytes are read at the pace of the busiest chip
    (`Workload.busiest_chip_share` of them, at one chip's bandwidth), and its collectives
    (``collectives``: `pallas_flash_estimate.program.ici.collective_entry` dicts, timed by the
    estimator's torus model, `ici.collective_seconds`) follow the kernels, so their time adds
    to the latency.
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
    exchange = figure(ici.entries_seconds(collectives, target), "model")
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


def in_place_writes(
    copies: Sequence[Mapping], donated: Sequence[tuple[int, ...]], temp_bytes: int
) -> list[Mapping]:
    """The copy-trap fusions of a row (``copies``, `hlo_ops.relayout_copies`) that write a
    donated argument in place rather than copy it: a fusion whose result has a donated
    argument's shape (``donated``) and more bytes than the program's temporaries
    (``temp_bytes``) has no buffer to be a copy in but the donated one, so it updates that
    array where it lies (an in-place scatter: the new tokens into their pages). Its HBM
    traffic is its updates, not the array twice, as the copy trap charges it; where such a
    fusion streams the whole array even so, the charge stands (the row's note gives both)."""
    shapes = set(map(tuple, donated))
    found = []
    for copy in copies:
        arrays = hlo.arrays(str(copy["shape"]))
        dims = tuple(arrays[0][1]) if len(arrays) == 1 else None
        if copy["opcode"] == "fusion" and dims in shapes and copy["bytes"] > temp_bytes:
            found.append(copy)
    return found
