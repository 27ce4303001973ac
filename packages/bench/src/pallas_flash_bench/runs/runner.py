"""``pallas-flash bench``: compile the sweep in workers, derive the figures, write the report."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import pathlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax

import pallas_flash as pf
from pallas_flash_bench import aot
from pallas_flash_bench.kernels import against_references, chip_scaling, row_figures
from pallas_flash_bench.kernels.references import all_subjects, reference_notes
from pallas_flash_bench.kernels.subjects import Subject, program_code_versions
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_bench.runs import measure
from pallas_flash_bench.runs.cache import ResultCache
from pallas_flash_bench.runs.workers import run_cached
from pallas_flash_bench.views.report import write_report
from pallas_flash_bench.views.roofline import write_roofline
from pallas_flash_estimate import ANALYSIS_VERSION, calibration
from pallas_flash_estimate.aot.devices import libtpu_version
from pallas_flash_estimate.targets import TARGETS, Target

if TYPE_CHECKING:
    from pallas_flash_bench.context.context_workloads import ContextWorkload
    from pallas_flash_bench.models.model_workloads import ModelWorkload

FIT_LIMIT = 1 << 21
"""Longest sequence the fit search tries: Q, K, V and O of B=1, H=16, D=128 bf16 at 2M tokens
already fill 16 GiB."""
FIT_STEP = 256


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    target: Target
    sweep: str
    workloads: list[Workload]
    models: list[ModelWorkload]
    """Model workloads (`model_workloads`; they need the LLaMa package)."""
    context: list[ContextWorkload]
    """Context-parallel workloads (`context_workloads`)."""
    backends: list[str] | None
    references: bool
    fit: bool
    measure: bool
    price_per_chip_hour: float
    out_dir: pathlib.Path
    cache: ResultCache
    workers: int
    notes: list[str] = dataclasses.field(default_factory=list)
    """What the run left out and why (a package not installed), for the report's notes."""


ROW_FORMAT = 13
"""The version of a kernel row as the bench's worker records it (`worker.analyse_row`): bump
it when that changes, and cached rows are recompiled. (How rows are costed is the
estimator's: its version is `pallas_flash_estimate.ANALYSIS_VERSION`.)"""


def versions() -> dict[str, str | None]:
    """Toolchain versions: every static figure depends on them (part of the cache key)."""
    return {
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "libtpu": libtpu_version(),
        "pallas_flash": importlib.metadata.version("pallas-flash-core"),
        "pallas_flash_bench": importlib.metadata.version("pallas-flash-bench"),
        "analysis": str(ANALYSIS_VERSION),
        "row_format": str(ROW_FORMAT),
    }


def _jobs(options: BenchOptions, subjects: dict[str, Subject]) -> list[dict]:
    common = {"sweep": options.sweep, "backends": options.backends,
              "references": options.references, "target": options.target.name,
              "topology": options.target.topology}  # fmt: skip
    jobs = [
        {"kind": "row", "subject": sid, "version": s.version, "workload": w.to_json(), **common}
        for w in options.workloads
        for sid, s in subjects.items()
    ]
    if options.fit:
        jobs += [
            {
                "kind": "fit",
                "subject": sid,
                "version": s.version,
                "op": op,
                "limit": FIT_LIMIT,
                "step": FIT_STEP,
                **common,
            }
            for sid, s in subjects.items()
            if s.kind == "backend"
            for op in ("forward", "forward_backward")
        ]
    code = program_code_versions() if options.models or options.context else {}
    jobs += [
        {"kind": kind, "workload": w.to_json(), "target": w.target,
         "topology": TARGETS[w.target].topology, "sweep": options.sweep, "backends": None,
         "references": False, "code": code}
        for kind, programs in (("model", options.models), ("context", options.context))
        for w in programs
    ]  # fmt: skip
    for i, job in enumerate(jobs):
        job["id"] = i
    return jobs


def _measure(row: dict, subject: Subject, workload: Workload) -> dict | None:
    platform = measure.platform()
    info = {i.name: i for i in pf.list_backends()}.get(subject.name)
    if subject.kind != "backend" or info is None or platform not in info.platforms:
        return None
    w = workload
    if platform == "cpu" and w.op == "ragged":
        row["notes"].append("not timed on CPU: a dense ragged step gathers each token's cache")
        return None
    if platform == "cpu":
        heads_rows = w.batch * w.q_heads * (1 if w.op == "decode" else w.seq_len)
        factor = 3 if w.op == "forward_backward" else 1
        if heads_rows * w.seq_len * 4 * factor > measure.CPU_SCORE_BYTES_LIMIT:
            row["notes"].append("not timed on CPU: the score matrix is too large for this host")
            return None
    devices = jax.devices()
    if w.chips > len(devices):
        row["notes"].append(f"not timed: it needs {w.chips} chips, this host has {len(devices)}")
        return None
    mesh = aot.mesh_of(devices, w.chips)
    fn = subject.build(workload, mesh)
    specs = subject.arguments(w)
    arrays = measure.random_arrays(specs, w)
    if mesh is not None:
        shardings = [aot.sharding(spec, mesh) for spec in specs]
        arrays = [jax.device_put(a, s) for a, s in zip(arrays, shardings, strict=True)]
    seconds = measure.median_seconds(fn, arrays)
    return row_figures.figure(seconds, f"measured-{platform}")


def run(options: BenchOptions) -> dict:
    """Runs the sweep and writes ``report.md``, ``results.json`` and ``roofline.png``."""
    toolchain = versions()
    subjects = all_subjects(options.sweep, options.backends, options.references)
    jobs = _jobs(options, subjects)
    notes = [*options.notes, *(reference_notes() if options.references else [])]
    if toolchain["libtpu"] is None:
        notes.append("libtpu is not installed: nothing was compiled for the TPU")
        print(
            "pallas-flash bench: libtpu is not installed, so nothing is compiled for the TPU; "
            "only CPU timings are reported. Install it with: pip install 'jax[tpu]'",
            file=sys.stderr,
        )
    compile_missing = toolchain["libtpu"] is not None
    desc = "compiling for " + options.target.name
    results = run_cached(jobs, toolchain, options.cache, options.workers, desc,
                         compile_missing=compile_missing)  # fmt: skip

    rows, fits, models, context = [], [], [], []
    for job in jobs:
        result = results.get(job["id"])
        if job["kind"] in ("model", "context"):
            row = _program_row(job, result, options)
            (models if job["kind"] == "model" else context).append(row)
            continue
        if job["kind"] == "fit":
            if result is not None and "job_error" not in result:
                fits.append(result)
            continue
        workload = Workload(**job["workload"])
        subject = subjects[job["subject"]]
        if result is None and compile_missing:
            continue  # the subject does not support this workload
        if result is None or "job_error" in result:
            result = _failed_row(subject, workload, result)
        rows.append(_with_figures(result, subject, workload, options))
    against_references.annotate(rows)
    chip_scaling.annotate(rows, options.target.hbm_bandwidth)
    output = {
        "meta": {
            "target": options.target.to_json(),
            "versions": toolchain,
            "date": datetime.date.today().isoformat(),
            "sweep": options.sweep,
            "price_per_chip_hour": options.price_per_chip_hour,
            "price_source": "on-demand list price per chip-hour (see pallas_flash_estimate.targets)"
            if options.price_per_chip_hour == options.target.price_per_chip_hour
            else "given with --price",
            "measured_on": measure.platform() if options.measure else None,
            "notes": notes,
        },
        "calibration": calibration.load(options.target.generation),
        "rows": rows,
        "fits": fits,
        "models": models,
        "ablation": _ablation_steps(options),
        "context": context,
    }
    options.out_dir.mkdir(parents=True, exist_ok=True)
    (options.out_dir / "results.json").write_text(json.dumps(output, indent=1))
    write_report(output, options.out_dir / "report.md")
    write_roofline(output, options.out_dir / "roofline.png")
    return output


def _ablation_steps(options: BenchOptions) -> list[tuple[str, str]]:
    """The model ablation's rows in order (`model_workloads.ablation_steps`), for the report's
    table; none without model workloads (which need the LLaMa package)."""
    if not options.models:
        return []
    from pallas_flash_bench.models.model_workloads import ablation_steps

    return ablation_steps()


def _program_row(job: dict, result: dict | None, options: BenchOptions) -> dict:
    """A model (`model_figures`) or context-parallel (`context_figures`) workload's analysis
    with its figures, or its error."""
    from pallas_flash_bench.context import context_figures
    from pallas_flash_bench.models import model_figures

    if result is None or "job_error" in result:
        error = "libtpu is not installed" if result is None else result["job_error"]
        return {"workload": job["workload"], "programs": [], "error": error, "figures": None}
    target = TARGETS[job["target"]]
    if job["kind"] == "context":
        figures = context_figures.derive(result, target)
    else:
        figures = model_figures.derive(result, target, options.price_per_chip_hour)
    return {**result, "error": None, "figures": figures}


def _failed_row(subject: Subject, workload: Workload, result: dict | None) -> dict:
    error = "libtpu is not installed" if result is None else result["job_error"]
    return {"subject": subject.name, "kind": subject.kind, "config": subject.config,
            "version": subject.version, "workload": workload.to_json(), "label": workload.label,
            "compiled": False, "error": error, "hbm": None, "copies": [], "kernels": [],
            "cost": None, "notes": []}  # fmt: skip


def charged_kernels(row: dict) -> list[dict]:
    """A row's kernel entries that run: all but those in a conditional branch the workload
    never takes (their entry says ``runs: False``)."""
    return [k for k in row["kernels"] if k.get("runs", True)]


def program_cycles(row: dict) -> int | None:
    """Static cycles of the whole program: its Pallas kernels that run and every XLA op
    around them.

    None when nothing was scheduled, and for programs without a Pallas kernel whose ops include
    loops of unknown trip count (their figure would be a mere lower bound; the roofline model
    is used instead).
    """
    other = row.get("other_ops")
    kernels = sum(k["cycles"] for k in charged_kernels(row))
    if other is None:
        return kernels if row["kernels"] else None
    if not row["kernels"] and other["undetermined"]:
        return None
    return kernels + other["cycles"]


def _dma_cycles(kernel: dict, target: Target) -> float | None:
    """Cycles the target's HBM needs for a kernel entry's block copies (None: not known)."""
    dma_bytes = kernel.get("dma_bytes")
    return None if dma_bytes is None else row_figures.dma_cycles(dma_bytes, target)


def program_estimates(row: dict, target: Target) -> dict[str, int | None]:
    """The whole program's static cycles under each estimate of `row_figures.SPREAD`: its
    kernels' figure plus the other ops' headline cycles; None where a kernel lacks it (or with
    no kernel)."""
    other = (row.get("other_ops") or {}).get("cycles", 0)
    kernels = charged_kernels(row)
    out: dict[str, int | None] = {}
    for name in row_figures.SPREAD:
        if name == "dma":
            dma = [_dma_cycles(k, target) for k in kernels]
            values = [
                None if d is None else max(k["cycles"], math.ceil(d))
                for k, d in zip(kernels, dma, strict=True)
            ]
        else:
            values = [(k.get("estimates") or {}).get(name) for k in kernels]
        known = bool(kernels) and None not in values
        out[name] = sum(values) + other if known else None
    return out


def calibrated_latency(row: dict, workload: Workload, target: Target) -> dict | None:
    """A row's latency by the committed calibration of its target's generation
    (`calibration`): its static compute time made a device time (its kernels' grid steps
    and first blocks charged), or its memory time if longer, plus its collectives; with the
    band of its kind and the MFU it gives. None without a static figure or a calibration.

    Every row is attention: unless its memory time outlasts its compute (decoding) it takes
    the band of timed attention kernels (``attention forward``; the backward's too, as no
    generation whose coefficients are fitted times a backward kernel: only v7x does, and it
    is validated only), not the band of matmuls."""
    figures = row["figures"]
    compute = figures["compute_seconds"]
    if compute["source"] != "static":
        return None
    kernels = charged_kernels(row)
    steps = sum(k["steps"] for k in kernels)
    fill = sum((k.get("dma_bytes") or 0) / max(k["steps"], 1) for k in kernels)
    memory = figures["memory_seconds"]["value"]
    program = calibration.ProgramFeatures(
        compute["value"], steps, fill / target.hbm_bandwidth,
        memory if memory > compute["value"] else 0.0,
    )  # fmt: skip
    declared = None if program.memory_bound_seconds else calibration.ATTENTION
    found = calibration.calibrate(program, target.generation, declared)
    if found is None:
        return None
    seconds = max(found.seconds, memory) + figures["collective_seconds"]["value"]
    mfu = workload.useful_flops / seconds / (target.peak_flops * workload.chips)
    return {"value": seconds, "source": "calibrated", "band": found.band, "kind": found.kind,
            "mfu": mfu}  # fmt: skip


def _dma_notes(row: dict, target: Target) -> list[str]:
    """A note per kernel whose block copies take longer than its compute: it cannot hide them,
    so it runs below its static figure."""
    notes = []
    for k in charged_kernels(row):
        dma = _dma_cycles(k, target)
        if dma is not None and k["cycles"] and dma > k["cycles"]:
            notes.append(
                f"{k['name']}: its block copies need {dma / k['cycles']:.2f}x its compute "
                f"({k['dma_bytes']} bytes at most over {k['steps']} steps): DMA-bound"
            )
    return notes


def _in_place_notes(
    row: dict, subject: Subject, workload: Workload, figures: Callable[[int], dict], copy_bytes: int
) -> list[str]:
    """A note where the copy trap charges fusions that write a donated argument in place
    (`row_figures.in_place_writes`): the latency with and without that charge."""
    temp = (row.get("hbm") or {}).get("temp")
    donated = [subject.arguments(workload)[i].shape for i in subject.donate(workload)]
    writes = row_figures.in_place_writes(row["copies"], donated, temp) if temp is not None else []
    if not writes:
        return []
    charged = row["figures"]["latency_seconds"]["value"]
    moved = sum(c["bytes"] for c in writes)
    in_place = figures(copy_bytes - moved)["latency_seconds"]["value"]
    names = ", ".join(c["name"] for c in writes)
    return [
        f"{names} ({moved / 1e9:.3g} GB) write a donated argument's whole shape; the program's "
        f"temporaries ({temp} bytes) hold no copy of it, so they update it in "
        f"place (row_figures.in_place_writes). The copy trap charges them as copies read and "
        f"written: {charged * 1e3:.4g} ms; charged their updates only, {in_place * 1e3:.4g} ms"
    ]


def _with_figures(row: dict, subject: Subject, workload: Workload, options: BenchOptions) -> dict:
    row = dict(row, notes=list(row["notes"]))
    row["static_cycles"] = program_cycles(row) if row["compiled"] else None
    if row["compiled"]:
        cost = row["cost"] or {}

        def figures(copy_bytes: int) -> dict:
            return row_figures.derive(
                workload,
                options.target,
                options.price_per_chip_hour,
                static_cycles=row["static_cycles"],
                has_kernels=row_figures.has_estimated_kernels(row["kernels"]),
                compiler_flops=cost.get("flops"),
                compiler_bytes=cost.get("bytes"),
                copy_bytes=copy_bytes,
                collectives=row["collectives"],
                min_hbm_bytes=subject.min_hbm_bytes(workload) if subject.min_hbm_bytes else None,
            )

        copy_bytes = sum(c["bytes"] for c in row["copies"])
        row["figures"] = figures(copy_bytes)
        row["notes"] += _in_place_notes(row, subject, workload, figures, copy_bytes)
        calibrated = calibrated_latency(row, workload, options.target)
        if calibrated is not None:
            row["figures"]["calibrated_latency_seconds"] = calibrated
        row["notes"] += _dma_notes(row, options.target)
        row["estimates"] = row_figures.spread(
            workload,
            options.target,
            program_estimates(row, options.target),
            row["figures"]["memory_seconds"]["value"],
            row["figures"]["collective_seconds"]["value"],
        )
        row["mfu_range"] = row_figures.mfu_range(row["figures"]["mfu"]["value"], row["estimates"])
        row["kernels"] = [
            dict(k, step_seconds=row_figures.step_seconds(k, options.target))
            for k in row["kernels"]
        ]
    else:
        row["figures"] = {}
    if options.measure:
        measured = _measure(row, subject, workload)
        if measured is not None:
            row["figures"]["measured_seconds"] = measured
    return row
