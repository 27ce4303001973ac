"""A context-parallel workload's figures from its two programs' analyses
(`context_steps.analyse_context`).

Every time is a static estimate at each of `model_figures.ENDS` (collectives hidden, as the
schedule places them, exposed). The step is held against a quarter, one over the chips, of
the one-chip program's time scaled by the token pairs (`ContextWorkload.pair_ratio`): what
each chip would take if the split cost nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pallas_flash_bench.context.context_workloads import ContextWorkload
from pallas_flash_bench.models.model_figures import ENDS, step_seconds
from pallas_flash_estimate.targets import Target


def derive(result: Mapping[str, Any], target: Target) -> dict:
    """``step_seconds``, ``share_seconds`` (the one-chip time per pair over the chips),
    ``against_share`` (step over share), ``mfu`` and ``tokens_per_second``, each ``{end:
    value}``; the ring's ``peak_hbm`` (or what it needed) and its share of a chip's,
    ``fits``, ``head_groups``, ``collective_bytes`` (a chip's, one step) and the compile
    time."""
    w = ContextWorkload(**result["workload"])
    programs = {p["program"]: p for p in result["programs"]}
    ring, one_chip = programs["ring"], programs["one chip"]
    estimate = ring.get("estimate") or {}
    out: dict[str, Any] = {
        "compiled": ring["compiled"] and one_chip["compiled"],
        "fits": ring["compiled"],
        "peak_hbm": ring["hbm"]["peak"] if ring["compiled"] else ring.get("needed_bytes"),
        "compile_seconds": sum(p.get("compile_seconds", 0.0) for p in programs.values()),
        "head_groups": result.get("head_groups"),
        "collective_bytes": sum(c["bytes"] * c["runs"] for c in estimate.get("collectives", [])),
    }
    out["peak_hbm_share"] = None if out["peak_hbm"] is None else out["peak_hbm"] / target.hbm_bytes
    keys = ("step_seconds", "share_seconds", "against_share", "mfu", "tokens_per_second")
    out.update({key: dict.fromkeys(ENDS) for key in keys})
    flops = w.attention(w.seq_len).useful_flops
    for end in ENDS:
        step, reference = step_seconds(ring, end), step_seconds(one_chip, end)
        if step is None:
            continue
        out["step_seconds"][end] = step
        out["mfu"][end] = flops / step / (target.peak_flops * w.chips)
        out["tokens_per_second"][end] = w.seq_len / step
        if reference is not None:
            share = reference * w.pair_ratio / w.chips
            out["share_seconds"][end] = share
            out["against_share"][end] = step / share
    return out
