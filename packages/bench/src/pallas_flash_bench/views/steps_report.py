"""The serving-step matrix (`sweeps.step_sweep`) at a glance: one line per kv-head share and
mix, one column per page size, each cell our step's speed-up over RPA v3's fastest
configuration on it, calibrated, with its verdict under every static estimate; then the
windowed-layer steps (`sweeps.window_sweep`), each beside the same step without its window.

The cells only format what the run's rows record (``row["against_references"]``,
`against_references.compare`); the full rows are the report's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pallas_flash_bench.kernels import against_references
from pallas_flash_bench.kernels.sweeps import (
    RAGGED_MIXES,
    STEP_MIXES,
    STEP_PAGE_SIZES,
    step_sweep,
    window_sweep,
)
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_bench.views.cells import MISSING, markdown_table, ms, workload_of
from pallas_flash_bench.views.comparison import verdict_summary

MIX_TITLES = {
    "decode": "decode only: 128 sequences",
    "vllm-512": "vLLM's 512-token step: a 448-token chunk beside 64 decodes",
    "vllm-2048": "vLLM's 2048-token step (prefill-heavy): 3 chunks of 640 beside 128 decodes",
}
"""How a line names each mix of `STEP_MIXES`."""


def mix_of(workload: Workload) -> str | None:
    """The mix of `RAGGED_MIXES` a ragged workload holds, or None."""
    held = (workload.batch, workload.prefill, workload.prefill_context)
    for name, mix in RAGGED_MIXES.items():
        if held == (mix["batch"], mix.get("prefill"), mix.get("prefill_context", 0)):
            return name
    return None


def _ragged_rows(rows: Sequence[Mapping[str, Any]], backend: str) -> dict[Workload, Mapping]:
    """``backend``'s ragged rows by workload."""
    return {
        Workload(**workload_of(row)): row
        for row in rows
        if row.get("subject") == backend and workload_of(row).get("op") == "ragged"
    }


def _matrix_rows(rows: Sequence[Mapping[str, Any]], backend: str) -> list[tuple[Workload, dict]]:
    """``backend``'s rows of the matrix's steps, each with its workload and its record against
    the references."""
    steps = set(step_sweep())
    return [
        (workload, row.get("against_references") or {})
        for workload, row in _ragged_rows(rows, backend).items()
        if workload in steps
    ]


def _cell(record: Mapping[str, Any]) -> str:
    """``1.02x ±16 %, level under every estimate``; the headline speed-up where no calibrated
    one was made."""
    calibrated = record.get("speedup_calibrated")
    speedup = calibrated if calibrated is not None else record.get("speedup")
    if speedup is None:
        return MISSING
    band = f" ±{record['band']:.0%}" if calibrated is not None else ""
    return f"{speedup:.2f}x{band}, {verdict_summary(record)}"


def steps_table(rows: Sequence[Mapping[str, Any]], backend: str = "splitkv") -> list[str]:
    """The matrix of ``backend``'s rows against RPA v3 (a section: title, intro, table), or
    nothing where the run holds no row of it."""
    cells: dict[tuple[int, int, str], dict[int, str]] = {}
    matrix = _matrix_rows(rows, backend)
    for w, record in matrix:
        against_rpa = "rpa" in str((record.get("fastest") or {}).get("subject"))
        key = (w.kv_heads, w.q_heads, mix_of(w))
        cells.setdefault(key, {})[w.page_size] = _cell(record) if against_rpa else MISSING
    if not cells:
        return []
    table = [
        [
            f"{kv} ({q} query heads)",
            MIX_TITLES[mix],
            *(found.get(p, MISSING) for p in STEP_PAGE_SIZES),
        ]
        for (kv, q, mix), found in sorted(cells.items(), key=lambda item: _order(item[0]))
    ]
    header = ["kv heads a chip", "step", *(f"pages of {p}" for p in STEP_PAGE_SIZES)]
    counts = _tally([record for _, record in matrix])
    tally = ", ".join(f"{v} on {n}" for v, n in counts.items() if n)
    intro = (
        f"`{backend}`'s `pf.ragged_attention` step against tpu-inference's RPA v3 at the "
        "fastest of its block configurations on the same step (a speed-up over 1x: ours "
        "faster), calibrated, with the band of the step's kind of program, then the verdict "
        "under each static estimate (ahead: a speed-up of at least 1 + band; level: within "
        "it). Both programs write the step's new keys and values into their pages. "
        f"Calibrated: {tally} of {sum(counts.values())} steps."
    )
    return ["## The serving-step matrix", "", intro, "", *markdown_table(header, table), ""]


def _latency(figures: Mapping[str, Any] | None) -> float | None:
    """The calibrated latency in ``figures`` (a row's, or a reference's record), else the
    static one."""
    figures = figures or {}
    for name in ("calibrated_latency_seconds", "latency_seconds"):
        value = (figures.get(name) or {}).get("value")
        if value is not None:
            return value
    return None


def _step_times(row: Mapping[str, Any] | None) -> tuple[float | None, float | None]:
    """Our step's latency and RPA v3's at its fastest on it (None where not recorded)."""
    if row is None:
        return None, None
    record = row.get("against_references") or {}
    fastest = record.get("fastest_calibrated") or record.get("fastest") or {}
    theirs = _latency(fastest.get("figures")) if "rpa" in str(fastest.get("subject")) else None
    return _latency(row.get("figures")), theirs


def _share(windowed: float | None, whole: float | None) -> str:
    """``0.52x`` (a windowed step's time over the same step's without its window)."""
    return MISSING if windowed is None or not whole else f"{windowed / whole:.2f}x"


def windows_table(rows: Sequence[Mapping[str, Any]], backend: str = "splitkv") -> list[str]:
    """The windowed-layer steps of ``backend``'s rows against RPA v3, each beside the step
    without its window (a section), or nothing where the run holds none of them."""
    found = _ragged_rows(rows, backend)
    table = []
    for w in window_sweep():
        if w.sliding_window is None or w not in found:
            continue
        ours, theirs = _step_times(found[w])
        our_whole, their_whole = _step_times(found.get(dataclasses.replace(w, sliding_window=None)))
        times = [ms(t) if t else MISSING for t in (ours, theirs)]
        record = found[w].get("against_references") or {}
        share = [_share(ours, our_whole), _share(theirs, their_whole)]
        table.append([MIX_TITLES[mix_of(w)], f"{w.sliding_window}", *times, _cell(record), *share])
    if not table:
        return []
    header = ["step", "window", "ours", "RPA v3 at its fastest", "ours against RPA v3",
              "ours / no window", "RPA v3 / no window"]  # fmt: skip
    w = window_sweep()[0]
    intro = (
        f"A windowed layer's step ({w.q_heads} query over {w.kv_heads} kv heads a chip, pages "
        f"of {w.page_size}): each token sees the window's positions up to its own, its own "
        "included (`sliding_window`, as a model config and RPA v3 count them). Times "
        "calibrated; the last two columns: the step's time over the same step's without a "
        "window, ours and RPA v3's (at its fastest on each), which falls below 1x as far as "
        "the kernel skips the pages outside the window."
    )
    return ["## Windowed layers", "", intro, "", *markdown_table(header, table), ""]


def _order(key: tuple[int, int, str]) -> tuple[int, int]:
    kv, _, mix = key
    return kv, STEP_MIXES.index(mix)


def _tally(records: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """How many of the matrix's records are ahead of, level with or behind the fastest
    reference, calibrated (`against_references.verdict` under the row's band)."""
    counts = {"ahead": 0, "level": 0, "behind": 0, "unknown": 0}
    for record in records:
        speedup = record.get("speedup_calibrated")
        counts[against_references.verdict(speedup, record.get("band", 0.0))] += 1
    return counts
