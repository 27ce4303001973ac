"""The serving-step matrix (`sweeps.step_sweep`) at a glance: one line per kv-head share and
mix, one column per page size, each cell our step's speed-up over RPA v3's fastest
configuration on it, calibrated, with its verdict under every static estimate.

The cells only format what the run's rows record (``row["against_references"]``,
`against_references.compare`); the full rows are the report's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pallas_flash_bench.kernels import against_references
from pallas_flash_bench.kernels.sweeps import RAGGED_MIXES, STEP_MIXES, STEP_PAGE_SIZES, step_sweep
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_bench.views.cells import MISSING, markdown_table, workload_of
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


def _matrix_rows(rows: Sequence[Mapping[str, Any]], backend: str) -> list[tuple[Workload, dict]]:
    """``backend``'s rows of the matrix's steps, each with its workload and its record against
    the references."""
    steps = set(step_sweep())
    found = []
    for row in rows:
        if row.get("subject") != backend or workload_of(row).get("op") != "ragged":
            continue
        workload = Workload(**workload_of(row))
        if workload in steps:
            found.append((workload, row.get("against_references") or {}))
    return found


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
