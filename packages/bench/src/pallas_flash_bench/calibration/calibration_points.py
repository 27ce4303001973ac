"""Published TPU measurements of programs we can compile exactly: the estimator's
calibration points (`calibration_point`, `pallas_flash_estimate.calibration`), by generation.

v5e's: jax's Pallas guides (matmuls timed from the host), tokamax's grouped matmuls, MaxText's
train steps and JetStream's serving runs. The other generations': tokamax's autotuning
timings (`tokamax_timings`). Each program is a `ProgramRef` into `calibration_programs`.
"""

from __future__ import annotations

from pallas_flash_bench.calibration import calibration_programs, tokamax_timings
from pallas_flash_bench.calibration.calibration_point import CalibrationPoint, Role
from pallas_flash_bench.models import maxtext_serving, maxtext_steps
from pallas_flash_estimate.aot.program_ref import ArraySpec, ProgramRef
from pallas_flash_estimate.calibration import ProgramFeatures

MATMUL_GUIDE = (
    "jax's Pallas TPU matmul guide, docs/pallas/tpu/matmul.ipynb (jax-ml/jax), its timed "
    "cells' outputs on a TPU v5e, bf16, timeit over 100 calls"
)
SPARSE_GUIDE = (
    "jax's Pallas TPU sparse guide, docs/pallas/tpu/sparse.ipynb (jax-ml/jax), the dense "
    "references' timed outputs on a TPU v5e, timeit over 100 calls"
)


def _bf16(*shape: int) -> ArraySpec:
    return ArraySpec(shape, "bfloat16")


GUIDE_TIMES = {
    # (bm, bk, bn) or None for XLA, variant -> {size: seconds}; the guide's printed times
    ((128, 128, 128), "plain"): {1024: 2.9766598949208854e-4, 4096: 0.011771515250438824,
                                 8192: 0.09183577066054567},
    ((512, 1024, 1024), "plain"): {1024: 1.2708659982308746e-4, 4096: 8.8908776990138e-4,
                                   8192: 6.099433819763363e-3},
    (None, "plain"): {1024: 1.1943008983507753e-4, 4096: 8.272899803705514e-4,
                      8192: 6.047147869830951e-3},
    ((128, 128, 128), "transposed"): {1024: 3.029372810851783e-4, 4096: 0.012017967159627005,
                                      8192: 0.09500920018996112},
    ((512, 1024, 1024), "transposed"): {1024: 1.2131539988331496e-4,
                                        4096: 8.790623804088682e-4, 8192: 6.107717020204291e-3},
    ((128, 128, 128), "relu"): {1024: 3.0103540048003196e-4, 4096: 0.011807117109419778,
                                8192: 0.09181861146935262},
    ((512, 1024, 1024), "relu"): {1024: 1.2622540001757442e-4, 4096: 8.96632740041241e-4,
                                  8192: 6.130605939542875e-3},
}  # fmt: skip
"""The matmul guide's timings (`MATMUL_GUIDE`), transcribed from its notebook's outputs."""

FIT_GUIDE_POINTS = {((128, 128, 128), "plain"), ((512, 1024, 1024), "plain"), (None, "plain")}
"""The guide's series the calibration is fitted on; its variants (transposed, relu) and the
other sources validate it."""


def matmul_guide_points() -> list[CalibrationPoint]:
    """The matmul guide's 21 timed programs: its kernel at two block shapes (plain, the
    right-hand side transposed, relu fused) and XLA's matmul, at 1024, 4096 and 8192 cubed."""
    points = []
    module = calibration_programs.__name__
    for (blocks, variant), times in GUIDE_TIMES.items():
        for n, seconds in times.items():
            if blocks is None:
                ref = ProgramRef(f"{module}:xla_matmul", (_bf16(n, n), _bf16(n, n)))
                name = f"XLA matmul {n}³"
            else:
                bm, bk, bn = blocks
                kwargs = {"bm": bm, "bk": bk, "bn": bn}
                if variant == "transposed":
                    kwargs["transpose_rhs"] = True
                if variant == "relu":
                    kwargs["activation"] = "relu"
                ref = ProgramRef(f"{module}:guide_matmul", (_bf16(n, n), _bf16(n, n)),
                                 tuple(sorted(kwargs.items())))  # fmt: skip
                label = "" if variant == "plain" else f", {variant}"
                name = f"Pallas matmul {n}³, blocks {bm}/{bk}/{bn}{label}"
            role: Role = "fit" if (blocks, variant) in FIT_GUIDE_POINTS else "validate"
            points.append(CalibrationPoint(name, ref, seconds, MATMUL_GUIDE, "host", role))
    return points


def sparse_guide_points() -> list[CalibrationPoint]:
    """The sparse guide's two dense XLA references at 16384³ (bf16): ``x @ y`` (46.953 ms)
    and ``mask * (x @ y)`` with an int32 mask (49.988 ms)."""
    module = calibration_programs.__name__
    n = 16384
    return [
        CalibrationPoint(f"XLA matmul {n}³", ProgramRef(f"{module}:xla_matmul",
                         (_bf16(n, n), _bf16(n, n))), 46.953e-3, SPARSE_GUIDE, "host",
                         "validate"),
        CalibrationPoint(f"XLA masked matmul {n}³ (int32 mask)",
                         ProgramRef(f"{module}:masked_matmul", (ArraySpec((n, n), "int32"),
                                    _bf16(n, n), _bf16(n, n))), 49.988e-3, SPARSE_GUIDE, "host",
                         "validate"),
    ]  # fmt: skip


def maxtext_points() -> list[CalibrationPoint]:
    """MaxText's published v5e training steps, each held against the estimate of MaxText's
    own compiled step (`maxtext_steps`, committed: compiling one takes a Python 3.12
    environment with maxtext, minutes and gigabytes of dump)."""
    points = []
    for name in maxtext_steps.STEPS:
        analysis = maxtext_steps.committed(name)
        if analysis is None or analysis["measured_seconds"] is None:
            continue  # not compiled here, or a script MaxText publishes no figure for
        points.append(CalibrationPoint(
            analysis["name"], None, analysis["measured_seconds"], analysis["step"]["source"],
            "device", "validate", analysis["estimate"], "train step",
        ))  # fmt: skip
    return points


def serving_points() -> list[CalibrationPoint]:
    """JetStream-MaxText's published serving throughput, held against the estimate of
    MaxText's own engine programs (`maxtext_serving`, committed) for a run at the reference's
    batch of ``generate_length`` decode steps, each sequence prefilled and inserted once: the
    time the published tokens/s implies for that run's tokens. The measured run's prompts
    were shorter (its requests' own lengths) and its batch continuous: a point for the kind
    ``serving run``, validated, not fitted."""
    points = []
    for name, ref in maxtext_serving.SERVING.items():
        analysis = maxtext_serving.committed(name)
        if analysis is None:
            continue
        batch, programs = analysis["batch"], analysis["programs"]
        runs = {"generate": ref.generate_length, "prefill": batch, "insert": batch}
        estimate = ProgramFeatures.run_estimate(
            [(programs[p]["estimate"], n) for p, n in runs.items()]
        )
        tokens = batch * ref.generate_length
        points.append(CalibrationPoint(
            analysis["name"], None, tokens / ref.published_tokens_per_second, ref.source,
            "device", "validate", estimate, "serving run",
        ))  # fmt: skip
    return points


def all_points(generation: str = "v5e") -> list[CalibrationPoint]:
    """Every calibration point of ``generation`` this installation can compile: on v5e the
    guides', tokamax's grouped matmuls and MaxText's programs; elsewhere tokamax's timings
    (`tokamax_timings`)."""
    if generation != "v5e":
        return tokamax_timings.points(generation)
    return [*matmul_guide_points(), *sparse_guide_points(), *tokamax_timings.points("v5e"),
            *maxtext_points(), *serving_points()]  # fmt: skip
