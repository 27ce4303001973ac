"""The report's context-parallelism section: each workload's static step on its slice
against a quarter (one over the chips) of one chip's time per token pair."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pallas_flash_bench.context.context_workloads import ContextWorkload
from pallas_flash_bench.views.cells import MISSING, byte_size, markdown_table, num, percent
from pallas_flash_bench.views.model_report import (
    OVERLAP_NOTE,
    ends_cell,
    peak_hbm_cell,
    seconds_cell,
)


def _row(row: Mapping[str, Any]) -> list[str]:
    w, f = row["workload"], row.get("figures") or {}
    name = ContextWorkload(**w).name
    if row.get("error"):
        return [name, f"not analysed: {row['error'][:120]}", *[MISSING] * 6]
    collectives = (row["programs"][0].get("estimate") or {}).get("collective_seconds")
    share = f"{ends_cell(f.get('share_seconds'), seconds_cell)} (N={w['reference_len']:,})"
    return [name, str(f.get("head_groups") or MISSING),
            ends_cell(f.get("step_seconds"), seconds_cell),
            ends_cell(f.get("mfu"), percent), share,
            ends_cell(f.get("against_share"), lambda x: f"{num(x)}x"),
            f"{byte_size(f.get('collective_bytes'))}, {seconds_cell(collectives)}",
            peak_hbm_cell(row)]  # fmt: skip


def context_section(results: Mapping[str, Any]) -> list[str]:
    """The section (none when the run had no context-parallel workloads)."""
    rows: Sequence[Mapping[str, Any]] = results.get("context") or []
    if not rows:
        return []
    header = ["forward+backward", "head groups", "step (static)", "MFU (static)",
              "one chip per pair / chips (static, at N)", "step / that",
              "collectives per chip (bytes, model)", "peak HBM per chip"]  # fmt: skip
    return ["## Context parallelism (v5e slices)", "",
            "One sequence, batch 1, bfloat16, split over every chip of the slice (zigzag: each "
            "chip an early and a late chunk), K/V passed round a ring or all gathered (`pallas`"
            " backend). The ring's branches (a pair of chunks skipped, diagonal or unmasked) "
            "are charged as often as the busiest chip takes them. Held against one chip's "
            "forward+backward at N tokens (`context_workloads`), scaled by the token pairs and "
            "divided by the chips: the step a split that cost nothing would take. "
            + OVERLAP_NOTE, "",
            *markdown_table(header, [_row(r) for r in rows]), ""]  # fmt: skip
