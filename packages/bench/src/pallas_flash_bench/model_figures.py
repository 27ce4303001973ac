"""A model workload's figures from its programs' analyses (`model_steps.analyse_model`).

Every time is a static estimate (`whole_program`) three ways: collectives wholly hidden under
the compute (``overlapped``), hidden as far as the compiled schedule places compute between
their starts and dones (``scheduled``, `overlap`), and not at all (``exposed``). A train step
gives MFU (`model_flops`, as MaxText counts it) and tokens/s per chip; a serving run gives its
tokens/s (all generated tokens over the prefill plus every decode step, each charged as the
run's average step: its kernels reading what a batch of every length the run reaches reads
(`model_steps`), its flops at the mean length, `ModelWorkload.mean_length`; the prefill steps
of ``prefill_batch`` prompts that take the whole batch) and tokens per dollar; both give the peak
HBM of their largest program.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pallas_flash_bench import model_flops
from pallas_flash_bench.targets import Target

ENDS = ("overlapped", "scheduled", "exposed")
"""The collectives' overlap with the compute each figure assumes (module doc)."""


def step_seconds(program: Mapping[str, Any], end: str) -> float | None:
    """A program's estimated step at one of `ENDS` (None when it has no estimate)."""
    estimate = program.get("estimate")
    return None if estimate is None else estimate.get(f"step_seconds_{end}")


def derive(result: Mapping[str, Any], target: Target, price_per_chip_hour: float) -> dict:
    """Figures of one analysed model workload: ``step_seconds``, ``mfu``, ``tokens_per_second``
    (and per chip), ``tokens_per_dollar``, each ``{end: value}``; ``peak_hbm``, ``fits``,
    the reference and the compile time."""
    from pallas_flash_bench.model_workloads import REFERENCES, ModelWorkload  # the LLaMa package

    w = ModelWorkload(**result["workload"])
    programs = {p["program"]: p for p in result["programs"]}
    config = w.config
    peak = [p["hbm"]["peak"] if p["compiled"] else p.get("needed_bytes")
            for p in programs.values()]  # fmt: skip
    out: dict[str, Any] = {
        "compiled": all(p["compiled"] for p in programs.values()),
        "compile_seconds": sum(p.get("compile_seconds", 0.0) for p in programs.values()),
        "peak_hbm": max((b for b in peak if b is not None), default=None),
        "fits": all(p["compiled"] for p in programs.values()),
        "reference": None,
    }
    if w.name in REFERENCES:
        ref = REFERENCES[w.name]
        out["reference"] = {"source": ref.source, "value": ref.value, "unit": ref.unit,
                            "note": ref.note}  # fmt: skip
    chip_seconds = price_per_chip_hour * w.chips / 3600
    peak_flops = target.peak_flops * w.chips
    for key in ("step_seconds", "mfu", "tokens_per_second", "tokens_per_chip_second",
                "tokens_per_dollar", "decode_step_seconds", "prefill_seconds"):  # fmt: skip
        out[key] = dict.fromkeys(ENDS)
    for end in ENDS:
        if w.step == "train":
            step = step_seconds(programs["train"], end)
            if step is None:
                continue
            flops = model_flops.train_step_flops(config, w.batch, w.seq_len)
            out["step_seconds"][end] = step
            out["mfu"][end] = flops / step / peak_flops
        else:
            prefill, decode = (
                step_seconds(programs["prefill"], end),
                step_seconds(programs["decode"], end),
            )
            if prefill is None or decode is None:
                continue
            prefill *= w.prefill_calls
            step = prefill + w.generate_len * decode
            out["prefill_seconds"][end], out["decode_step_seconds"][end] = prefill, decode
            out["step_seconds"][end] = step
            flops = model_flops.decode_step_flops(config, w.batch, w.mean_length)
            out["mfu"][end] = flops / decode / peak_flops
        out["tokens_per_second"][end] = w.tokens / step
        out["tokens_per_chip_second"][end] = w.tokens / step / w.chips
        out["tokens_per_dollar"][end] = w.tokens / step / chip_seconds
    return out


def against_reference(figures: Mapping[str, Any]) -> dict[str, float | None]:
    """Ours over the reference's figure (MFU or tokens/s), at each end; None without one."""
    ref = figures.get("reference")
    key = {"mfu": "mfu", "tokens/s": "tokens_per_second"}.get((ref or {}).get("unit"))
    if key is None:
        return dict.fromkeys(ENDS)
    return {end: (None if figures[key][end] is None else figures[key][end] / ref["value"])
            for end in ENDS}  # fmt: skip
