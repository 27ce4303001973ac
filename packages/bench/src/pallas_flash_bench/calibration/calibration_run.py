"""``pallas-flash bench --calibrate``: every calibration point (`calibration_points`)
compiled and estimated in the workers, the calibration fitted (`calibration`), and
``calibration.json`` and ``calibration.md`` written."""

from __future__ import annotations

import json
import pathlib

from pallas_flash_bench.calibration import calibration_points
from pallas_flash_bench.runs.cache import ResultCache
from pallas_flash_bench.runs.workers import run_cached
from pallas_flash_bench.views import calibration_report
from pallas_flash_estimate import ANALYSIS_VERSION, calibration
from pallas_flash_estimate.aot.program_ref import ProgramRef
from pallas_flash_estimate.targets import Target


def program_job(ref: ProgramRef, target: Target) -> dict:
    """The worker job that compiles and estimates ``ref`` (`pallas_flash_estimate.aot.worker`)."""
    return {"kind": "program", "program": ref.to_json(), "target": target.name,
            "topology": target.topology, "sweep": None,
            "backends": None, "references": False}  # fmt: skip


def error_of(result: dict | None) -> str | None:
    """A worker result's error: the job's own (the worker failed), the program's, or why its
    estimate is refused (`pallas_flash_estimate.program.sanity`: loops its flops cannot
    explain)."""
    result = result or {}
    refused = (result.get("estimate") or {}).get("implausible_ops")
    if refused:
        return f"no estimate: the counted loops do not explain it ({'; '.join(refused)})"
    return result.get("job_error") or result.get("error")


def estimate_of(result: dict | None) -> dict | None:
    """A worker result's estimate, None where there is none or it is refused (`error_of`)."""
    estimate = (result or {}).get("estimate")
    return None if not estimate or estimate.get("implausible_ops") else estimate


def attention_figures(
    result: dict | None, generation: str, kind: str = calibration.ATTENTION
) -> dict | None:
    """A worker result's static and calibrated seconds as an attention kernel of ``kind``
    (forward or backward: the generation's band of it), and whether its estimate is an upper
    bound; None without an estimate."""
    estimate = estimate_of(result)
    if estimate is None:
        return None
    features = calibration.ProgramFeatures.of_estimate(estimate)
    found = calibration.calibrate(features, generation, kind)
    return {"static_seconds": features.static_seconds,
            "calibrated_seconds": None if found is None else found.seconds,
            "upper_bound": features.upper_bound}  # fmt: skip


def run(target: Target, versions: dict, cache: ResultCache, workers: int,
        out_dir: pathlib.Path) -> dict:  # fmt: skip
    """The calibration of ``target``'s generation from every point of it this installation
    can compile (tokamax's only with tokamax installed); written to ``out_dir``."""
    points = calibration_points.all_points(target.generation)
    jobs = [dict(program_job(p.program, target), id=i)
            for i, p in enumerate(points) if p.program is not None]  # fmt: skip
    results = run_cached(jobs, versions, cache, workers, "calibration points")
    analysed = []
    for i, point in enumerate(points):
        if point.program is None:  # estimated elsewhere (MaxText's step)
            analysed.append({"point": point.to_json(), "estimate": point.estimate, "error": None})
            continue
        result = results[i]
        analysed.append({"point": point.to_json(), "estimate": estimate_of(result),
                         "error": error_of(result)})  # fmt: skip
    donor = calibration.COEFFICIENTS_FROM.get(target.generation)
    given = None if donor is None else calibration.load(donor)["coefficients"]
    found = calibration.calibrate_points(analysed, versions, given)
    if donor is not None:
        found["coefficients_from"] = donor
    found["generation"] = target.generation
    found["analysis"] = ANALYSIS_VERSION
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "calibration.json").write_text(json.dumps(found, indent=1) + "\n")
    (out_dir / "calibration.md").write_text("\n".join(calibration_report.section(found)) + "\n")
    return found
