"""A model workload's figures from its programs' analyses (`model_steps.analyse_model`).

Every time is a static estimate (`whole_program`) three ways: collectives wholly hidden under
the compute (``overlapped``), hidden as far as the compiled schedule places compute between
their starts and dones (``scheduled``, `overlap`), and not at all (``exposed``). A train step
gives MFU (`model_flops`, as MaxText counts it) and tokens/s per chip; a serving run gives its
tokens/s (all generated tokens over the prefill plus every decode step, each charged as the
run's average step: its kernels reading what a batch of every length the run reaches reads
(`model_steps`), its flops at the mean length, `ModelWorkload.mean_length`; the prefill steps
of ``prefill_batch`` prompts that take the whole batch, each with its insert into the decode
batch) and tokens per dollar; an engine step (`model_steps`) its latency, MFU (the flops of
its new tokens, `model_flops.engine_step_flops`) and tokens/s: one sampled token per decoding
sequence over the step (a steady-state step stands for every step of its run: its tokens/s
is the run's), and the step under each way its slots may sample (`sampler_branches`); all
give the peak HBM of their largest program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pallas_flash_bench.models import model_flops
from pallas_flash_estimate import calibration
from pallas_flash_estimate.program.whole_program import ENDS
from pallas_flash_estimate.targets import SENSITIVITY, Target


def step_seconds(program: Mapping[str, Any], end: str) -> float | None:
    """A program's estimated step at one of `ENDS` (None when it has no estimate)."""
    estimate = program.get("estimate")
    return None if estimate is None else estimate.get(f"step_seconds_{end}")


def derive(result: Mapping[str, Any], target: Target, price_per_chip_hour: float) -> dict:
    """Figures of one analysed model workload: ``step_seconds``, ``mfu``, ``tokens_per_second``
    (and per chip), ``tokens_per_dollar``, each ``{end: value}``; ``peak_hbm`` (and its share
    of a chip's), ``fits``, the reference and ours against it (`against_reference`,
    `against_reference_program`), per program the async copies its schedule hides, and the
    compile time."""
    from pallas_flash_bench.models.model_workloads import (  # the LLaMa package
        REFERENCES,
        ModelWorkload,
    )

    w = ModelWorkload(**result["workload"])
    programs = {p["program"]: p for p in result["programs"]}
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
        found = _step_figures(w, lambda name, end=end: step_seconds(programs[name], end),
                              peak_flops)  # fmt: skip
        for key, value in (found or {}).items():
            out[key][end] = value
        if found is not None:
            out["tokens_per_dollar"][end] = found["tokens_per_second"] / chip_seconds
    out["sensitivity"] = {
        name: _step_figures(w, lambda p, name=name: _moved(programs[p], name), peak_flops)
        for name in SENSITIVITY
    }  # fmt: skip
    out["calibrated"] = _calibrated(w, programs, target, peak_flops)
    out["reference_program"] = _reference_program(w.name, target)
    out["against_reference"] = against_reference(out)
    out["against_reference_program"] = against_reference_program(out)
    out["copies_hidden_seconds"] = {
        name: e["compute_seconds"] - e["compute_seconds_copies_overlapped"]
        for name, p in programs.items()
        if (e := p.get("estimate")) is not None
    }  # what of each program's async copies its schedule hides beside the compute alone
    out["peak_hbm_share"] = None if out["peak_hbm"] is None else out["peak_hbm"] / target.hbm_bytes
    by_sampling = [p["sampling"] for p in programs.values() if "sampling" in p]
    out["step_seconds_by_sampling"] = by_sampling[0] if by_sampling else None  # engine steps
    return out


REFERENCE_PROGRAMS = {"train maxtext-16b": "16b", "train llama-2-7b": "llama2-7b"}
"""Train rows whose reference's own step was compiled and estimated (`maxtext_steps`)."""

REFERENCE_SERVING = {
    "serve llama-2-7b, maxtext settings": "llama2-7b",
    "engine llama-2-7b, maxtext settings": "llama2-7b",
}
"""Serving rows whose reference's own programs (MaxText's engine) were compiled and estimated
(`maxtext_serving`)."""


def _reference_program(name: str, target: Target) -> dict[str, Any] | None:
    """The reference's own compiled programs under the same estimator: a train step's
    ``step_seconds`` and ``mfu`` (by the same flop count as ours), a serving run's
    ``tokens_per_second``, each at every end; None where it has none."""
    from pallas_flash_bench.models import maxtext_serving, maxtext_steps

    if name in REFERENCE_SERVING:
        served = maxtext_serving.committed(REFERENCE_SERVING[name])
        if served is None:
            return None
        return {"name": served["name"], "tokens_per_second": served["tokens_per_second"],
                "analysis": served["analysis"]}  # fmt: skip
    analysis = (
        maxtext_steps.committed(REFERENCE_PROGRAMS[name]) if name in REFERENCE_PROGRAMS else None
    )
    if analysis is None:
        return None
    steps = {end: analysis["estimate"][f"step_seconds_{end}"] for end in ENDS}
    mfu = {
        end: analysis["flops_per_chip"] / step / target.peak_flops for end, step in steps.items()
    }
    return {"name": analysis["name"], "step_seconds": steps, "mfu": mfu,
            "analysis": analysis["analysis"]}  # fmt: skip


def _step_figures(w: Any, step_of: Any, peak_flops: float) -> dict[str, float] | None:
    """``step_seconds``, ``mfu``, ``tokens_per_second`` (and per chip), and for a serving run
    ``prefill_seconds`` (every prefill step with its insert into the decode batch) and
    ``decode_step_seconds`` (with its sampling), from ``step_of(program name)``, each
    program's step (None where one has none)."""
    config = w.config
    if w.step == "train":
        step = step_of("train")
        if step is None:
            return None
        flops = model_flops.train_step_flops(config, w.batch, w.seq_len)
        out = {"step_seconds": step, "mfu": flops / step / peak_flops}
    elif w.step == "engine":
        step = step_of("step")
        if step is None:
            return None
        flops = model_flops.engine_step_flops(config, w.engine_mix())
        out = {"step_seconds": step, "mfu": flops / step / peak_flops}
    else:
        prefill, insert, decode = step_of("prefill"), step_of("insert"), step_of("decode")
        if prefill is None or insert is None or decode is None:
            return None
        prefill = (prefill + insert) * w.prefill_calls
        step = prefill + w.generate_len * decode
        flops = model_flops.decode_step_flops(config, w.batch, w.mean_length)
        out = {"prefill_seconds": prefill, "decode_step_seconds": decode, "step_seconds": step,
               "mfu": flops / decode / peak_flops}  # fmt: skip
    out["tokens_per_second"] = w.tokens / step
    out["tokens_per_chip_second"] = w.tokens / step / w.chips
    return out


def _moved(program: Mapping[str, Any], name: str) -> float | None:
    """A program's scheduled step with one constant of `targets.SENSITIVITY` moved."""
    moved = ((program.get("estimate") or {}).get("sensitivity") or {}).get(name) or {}
    return moved.get("scheduled")


def _calibrated(w: Any, programs: Mapping[str, Any], target: Target,
                peak_flops: float) -> dict[str, Any] | None:  # fmt: skip
    """The figures of every program's scheduled step made a device time by the committed
    calibration (`calibration`), with the widest band of their kinds (None: no calibration,
    or a kind without a point)."""
    found = {}
    for name, program in programs.items():
        estimate = program.get("estimate")
        if estimate is None or "kernel_grid_steps" not in estimate:
            return None
        # our kernels' undecided regions are weighed by their occupancy (`model_steps`), not
        # charged in full: never of the data-dependent kind
        features = dataclasses.replace(
            calibration.ProgramFeatures.of_estimate(estimate), undecided_seconds=0.0
        )
        declared = "train step" if w.step == "train" else "serving run"  # an engine's too
        found[name] = calibration.calibrate(features, target.generation, declared)
    if any(c is None for c in found.values()):
        return None
    figures = _step_figures(w, lambda name: found[name].seconds, peak_flops)
    bands = [c.band for c in found.values()]
    band = None if None in bands else max(bands)
    kinds = sorted({c.kind for c in found.values()})
    return None if figures is None else {**figures, "band": band, "kinds": kinds}


PROGRAM_RATIOS = {"mfu": True, "tokens_per_second": True, "step_seconds": False}
"""The figures held against the reference's own programs, and whether the ratio is ours over
theirs (a rate) or theirs over ours (a time: our speed-up)."""


def against_reference_program(figures: Mapping[str, Any]) -> dict[str, Any]:
    """Per figure of `PROGRAM_RATIOS` the reference's own programs have (``reference_program``,
    the same estimator): ours against theirs at each end (``ratio``) and the verdict under the
    row's calibrated band: ``ahead``, ``behind``, or ``level`` where the ratio at some end lies
    within it (``verdict``; None without a band)."""
    program = figures.get("reference_program")
    band = (figures.get("calibrated") or {}).get("band")
    out: dict[str, Any] = {}
    for key, ours_first in PROGRAM_RATIOS.items():
        if program is None or key not in program:
            continue
        theirs, ours = program[key], figures.get(key) or {}
        ratio = {end: (ours[end] / theirs[end] if ours_first else theirs[end] / ours[end])
                 for end in theirs if ours.get(end) and theirs[end]}  # fmt: skip
        verdict = None
        if ratio and band is not None:
            lo, hi = min(ratio.values()), max(ratio.values())
            verdict = "ahead" if lo > 1 + band else "behind" if hi < 1 - band else "level"
        out[key] = {"ratio": ratio, "verdict": verdict, "band": band}
    return out


def against_reference(figures: Mapping[str, Any]) -> dict[str, float | None]:
    """Ours over the reference's figure (MFU or tokens/s), at each end; None without one."""
    ref = figures.get("reference")
    key = {"mfu": "mfu", "tokens/s": "tokens_per_second"}.get((ref or {}).get("unit"))
    if key is None:
        return dict.fromkeys(ENDS)
    return {end: (None if figures[key][end] is None else figures[key][end] / ref["value"])
            for end in ENDS}  # fmt: skip
