"""Published TPU v5e measurements of programs we can compile exactly: the estimator's
calibration points (`calibration`).

Each point is a program (`ProgramRef` into `calibration_programs`), the time its source
measured on a v5e chip, the source, and how it was timed:

- ``host``: wall clock around one call from Python (``timeit`` of ``block_until_ready(f(x))``,
  as jax's guides time): the device time plus a dispatch and synchronisation cost per call;
- ``device``: the op's own time on the device (a profiler's), nothing around it.

``role`` says whether the calibration is fitted on the point (``fit``) or only held against
it (``validate``): the fit never sees the validation points.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from pallas_flash_bench.calibration import calibration_programs
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
TOKAMAX_DATA = (
    "tokamax 0.0.12's shipped autotuning data, tokamax/data/autotuning/tpu_v5_lite/"
    "pallas_mosaic_tpu_ragged_dot.json (median of its evaluation times, profiled on the device)"
)

Timing = Literal["host", "device"]
Role = Literal["fit", "validate"]


@dataclasses.dataclass(frozen=True)
class CalibrationPoint:
    """One program and the time a source measured for it on one v5e chip.

    ``program``: compiled by the calibration run (`pallas_flash_estimate.aot.worker`); or
    None, with ``estimate`` its whole-program estimate made elsewhere (MaxText's step:
    `maxtext_steps`). ``kind``: the kind of program it stands for where that is not read
    from its estimate (``train step``)."""

    name: str
    program: ProgramRef | None
    measured_seconds: float
    source: str
    timing: Timing
    role: Role
    estimate: Mapping[str, Any] | None = None
    kind: str | None = None

    def to_json(self) -> dict[str, object]:
        program = None if self.program is None else self.program.to_json()
        return {"name": self.name, "program": program, "kind": self.kind,
                "measured_seconds": self.measured_seconds, "source": self.source,
                "timing": self.timing, "role": self.role}  # fmt: skip


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


def gmm_steps(group_sizes: list[int], tiles: dict[str, int], k: int, n: int) -> int:
    """The grid steps of tokamax's forward grouped matmul, ``(n / tile_n, m tiles visited,
    k / tile_k)``, whose middle size is computed at run time: per non-empty group, the m tiles
    its rows touch (its start rounded down, its end up)."""
    tile_m = tiles["tile_m"]
    visited, start = 0, 0
    for size in group_sizes:
        if size:
            visited += math.ceil((start + size) / tile_m) - start // tile_m
        start += size
    return n // tiles["tile_n"] * visited * (k // tiles["tile_k"])


TOKAMAX_FIT = ("bf16[131072,2048]", "bf16[128,2048,768]")
"""The tokamax point the calibration is fitted on (lhs, rhs); the others validate it."""


def _spec(text: str) -> ArraySpec:
    dtype, dims = text.rstrip("]").split("[")
    return ArraySpec(tuple(int(d) for d in dims.split(",")), {"bf16": "bfloat16"}[dtype])


def tokamax_points() -> list[CalibrationPoint]:
    """tokamax's grouped matmul (forward, no residuals) at each shape its v5e data times,
    in the configuration timed; none when tokamax is not installed."""
    try:
        data_dir = importlib.resources.files("tokamax") / "data" / "autotuning" / "tpu_v5_lite"
        data = json.loads((data_dir / "pallas_mosaic_tpu_ragged_dot.json").read_text())
    except (ModuleNotFoundError, FileNotFoundError):
        return []
    module = calibration_programs.__name__
    points = []
    for key, configs in data.items():
        call = json.loads(key)
        lhs, rhs = _spec(call["lhs"]), _spec(call["rhs"])
        numbers = call["ragged_dot_dimension_numbers"]
        plain = numbers["dot_dimension_numbers"] == [[[1], [1]], [[], []]] and len(rhs.shape) == 3
        if call["return_residuals"] or call["activation"] or not plain or not configs:
            continue  # the forward kernel alone, lhs [m, k] @ rhs [groups, k, n]
        ((config_key, timed),) = configs.items()
        config = json.loads(config_key)
        if config.get("combine_scopes"):
            continue
        groups = call["group_sizes"]
        kwargs = {k: config[k] for k in ("tile_m", "tile_k", "tile_n", "input_buffer_count")}
        m, k = lhs.shape
        steps = gmm_steps(groups, config, k, rhs.shape[2])
        ref = ProgramRef(f"{module}:tokamax_ragged_dot",
                         (lhs, rhs, ArraySpec((len(groups),), "int32")),
                         tuple(sorted(kwargs.items())), (("gmm_megablox", (steps,)),))  # fmt: skip
        name = (f"tokamax ragged_dot {m}x{k} @ {len(groups)}x{rhs.shape[1]}x{rhs.shape[2]}, "
                f"tiles {config['tile_m']}/{config['tile_k']}/{config['tile_n']}")  # fmt: skip
        role: Role = "fit" if (call["lhs"], call["rhs"]) == TOKAMAX_FIT else "validate"
        seconds = float(np.median(timed["evaluation_times_ms"])) / 1e3
        points.append(CalibrationPoint(name, ref, seconds, TOKAMAX_DATA, "device", role))
    return points


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


def all_points() -> list[CalibrationPoint]:
    """Every calibration point this installation can compile, and MaxText's programs."""
    return [*matmul_guide_points(), *sparse_guide_points(), *tokamax_points(), *maxtext_points(),
            *serving_points()]  # fmt: skip
