"""A decode row against its workload's HBM time and, on several chips, against the same
subject's row on one chip: the figures of the report's "Decoding one sequence" table,
computed when a run's rows are made (`annotate`) and kept in ``results.json``.

A decode row's record, ``row["chip_scaling"]``:

- ``hbm_time_seconds``: the least the workload must move (`Workload.min_hbm_bytes`) over the
  HBM bandwidth of the chips it runs on: the roofline a decode step cannot beat;
- ``latency_over_hbm_time``: the row's headline latency over that;
- ``speedup_over_one_chip``: on several chips, the one-chip row's latency over the row's
  (None without that row, or on one chip).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pallas_flash_bench.kernels.row_figures import figure_value
from pallas_flash_bench.kernels.workloads import Workload


def one_chip_twin(
    row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]
) -> Mapping[str, Any] | None:
    """The same subject's row (same configuration) of the same workload on one chip, or None."""
    single = {**row["workload"], "chips": 1}
    for other in rows:
        same = (other.get("subject"), other.get("config")) == (
            row.get("subject"),
            row.get("config"),
        )
        if same and {"chips": 1, **(other.get("workload") or {})} == single:
            return other
    return None


def record(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
           hbm_bandwidth: float) -> dict[str, float | None]:  # fmt: skip
    """``row``'s record (the module docstring), its one-chip twin looked up in ``rows``."""
    workload = Workload(**row["workload"])
    hbm_time = workload.min_hbm_bytes / hbm_bandwidth / workload.chips
    latency = figure_value(row, "latency_seconds")
    twin = one_chip_twin(row, rows) if workload.chips > 1 else None
    twin_latency = None if twin is None else figure_value(twin, "latency_seconds")
    return {
        "hbm_time_seconds": hbm_time,
        "latency_over_hbm_time": latency / hbm_time,
        "speedup_over_one_chip": twin_latency / latency if twin_latency else None,
    }


def annotate(rows: Sequence[dict[str, Any]], hbm_bandwidth: float) -> None:
    """Sets ``chip_scaling`` on every decode row of a backend with a latency."""
    for row in rows:
        row.pop("chip_scaling", None)
        workload = row.get("workload") or {}
        if (
            workload.get("op") == "decode"
            and row.get("kind") != "reference"
            and figure_value(row, "latency_seconds")
        ):
            row["chip_scaling"] = record(row, rows, hbm_bandwidth)
