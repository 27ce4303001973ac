"""The report's look at the compiled code: each kernel's VLIW schedule per grid step (bundles,
unit utilisation, VMEM, compute against DMA) and the copies the compiler put around the
kernels (the copy trap)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pallas_flash_bench.views.cells import (
    MISSING,
    byte_size,
    finite_number,
    integer,
    label,
    markdown_table,
    num,
    op_then_sort_key,
    percent,
    subject,
)

UTILIZATION_UNITS = ("MXU", "VALU", "EUP", "VLOAD", "VSTORE")
NO_COPIES = "No copy, transpose or pad around the kernels"


def _grid(grid: Any) -> str:
    if not grid:
        return MISSING
    return "x".join(str(g) for g in grid)


def _us(seconds: Any) -> str:
    """A time in microseconds, ``11.2 us``; ``—`` without one."""
    seconds = finite_number(seconds)
    return MISSING if seconds is None else f"{num(seconds * 1e6)} us"


def kernels_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The "Kernel schedules" section: each compiled kernel's bundles, grid, unit
    utilisation, VMEM and compute per grid step against its DMA per step (its
    ``step_seconds``: `row_figures.step_seconds`)."""
    lines = ["## Kernel schedules", ""]
    with_kernels = sorted((r for r in rows if r.get("kernels")), key=op_then_sort_key)
    if not with_kernels:
        return [*lines, "No kernel schedules were extracted.", ""]
    lines += [
        "From the compiler's VLIW bundles: utilisation is the share of bundles that keep the unit "
        "busy (static, an upper bound). Pushes: `vmatpush` instructions (weights loaded into an "
        "MXU) in the grid loop body, all MXUs. DMA/step: the bytes the kernel's block copies "
        "move per grid step (at most: copies whose predicate the schedule cannot decide counted "
        "every step) over the HBM bandwidth, against its compute per step (headline cycles): a "
        "kernel whose DMA/step exceeds its compute/step cannot hide its copies.",
        "",
    ]
    header = (
        "Subject",
        "Workload",
        "Kernel",
        "Bundles/step",
        "Steps",
        "Grid",
        "Predicated bundles",
        *(f"{unit} %" for unit in UTILIZATION_UNITS),
        "Spills (stores/fills)",
        "MXU ops",
        "Pushes",
        "VMEM",
        "Cycles",
        "Compute/step",
        "DMA/step",
    )
    table = []
    for row in with_kernels:
        for kernel in row["kernels"]:
            utilization = kernel.get("utilization") or {}
            per_step = kernel.get("step_seconds") or {}
            spills = f"{integer(kernel.get('spill_stores'))} / {integer(kernel.get('fill_loads'))}"
            table.append(
                [
                    subject(row),
                    label(row),
                    kernel.get("name") or MISSING,
                    integer(kernel.get("bundles_per_step")),
                    integer(kernel.get("steps")),
                    _grid(kernel.get("grid")),
                    integer(kernel.get("predicated_bundles")),
                    *(percent(utilization.get(unit)) for unit in UTILIZATION_UNITS),
                    spills,
                    integer(kernel.get("mxu_ops")),
                    integer(kernel.get("pushes")),
                    byte_size(kernel.get("vmem_bytes")),
                    num(kernel.get("cycles")),
                    _us(per_step.get("compute")),
                    _us(per_step.get("dma")),
                ]
            )
    return [*lines, *markdown_table(header, table), ""]


def copies_section(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The "Copy trap" section: every copy, transpose or pad the compiler put around a row's
    kernels."""
    lines = ["## Copy trap", ""]
    compiled = sorted((r for r in rows if r.get("compiled")), key=op_then_sort_key)
    with_copies = [r for r in compiled if r.get("copies")]
    if not compiled:
        return [*lines, "Nothing compiled.", ""]
    if not with_copies:
        return [*lines, f"{NO_COPIES}.", ""]
    header = ("Subject", "Workload", "Name", "Opcode", "Shape", "Bytes", "Detail")
    table = [
        [
            subject(row),
            label(row),
            copy.get("name") or MISSING,
            copy.get("opcode") or MISSING,
            copy.get("shape") or MISSING,
            byte_size(copy.get("bytes")),
            copy.get("detail") or "",
        ]
        for row in with_copies
        for copy in row["copies"]
    ]
    lines += [*markdown_table(header, table), ""]
    clean = len(compiled) - len(with_copies)
    if clean:
        lines += [f"{NO_COPIES} in the other {clean} compiled row{'s' if clean > 1 else ''}.", ""]
    return lines
