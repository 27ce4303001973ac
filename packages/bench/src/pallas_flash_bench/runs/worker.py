"""The compile worker: a subprocess that compiles jobs for a TPU target and analyses them.

The LLO dump flag of libtpu is read once, when libtpu starts, so compiles that need bundle
dumps run in a process started with ``LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR``. The worker
reads a list of jobs from a JSON file and prints one ``RESULT_PREFIX`` line of JSON per job
as it finishes, so the parent can show progress.

Run: ``python -m pallas_flash_bench.runs.worker JOBS.json [DUMP_DIR]``.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
import sys
import traceback

from pallas_flash_estimate.aot.worker import RESULT_PREFIX


def _error_text(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: " + " ".join(lines[:6])[:600]


def analyse_row(
    subject, workload, target, dump_dir: pathlib.Path | None, keep_hlo: bool = False
) -> dict | None:
    """Compiles one subject on one workload; returns the raw analysis, or None if unsupported.

    With ``keep_hlo`` the optimised HLO text is kept in the row (for ``pallas-flash inspect``).
    """
    from pallas_flash_bench import aot
    from pallas_flash_estimate.aot.devices import cost_analysis
    from pallas_flash_estimate.cost import llo, spread
    from pallas_flash_estimate.program import ici
    from pallas_flash_estimate.read import hlo_ops

    mesh = aot.call_mesh(target, workload.chips)
    fn = subject.build(workload, mesh)
    if fn is None:
        return None
    row = {
        "subject": subject.name,
        "kind": subject.kind,
        "config": subject.config,
        "version": subject.version,
        "workload": workload.to_json(),
        "label": workload.label,
        "compiled": False,
        "error": None,
        "hbm": None,
        "copies": [],
        "collectives": [],
        "kernels": [],
        "other_ops": None,
        "cost": None,
        "notes": [],
    }
    if dump_dir is not None:
        shutil.rmtree(dump_dir, ignore_errors=True)
        dump_dir.mkdir(parents=True)
    try:
        compiled = aot.compile_for(
            fn,
            subject.arguments(workload),
            target,
            mesh,
            aot.whole_vmem_options(target) if subject.whole_vmem else None,
            subject.donate(workload),
        )
    except Exception as exc:  # noqa: BLE001 - a compiler error is a result, not a crash
        row["error"] = _error_text(exc)
        return row
    row["compiled"] = True
    memory = compiled.memory_analysis()
    total = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
    row["hbm"] = {
        "temp": memory.temp_size_in_bytes,
        "argument": memory.argument_size_in_bytes,
        "output": memory.output_size_in_bytes,
        "total": total,
        "fits": total <= target.hbm_bytes,
    }
    cost = cost_analysis(compiled)
    row["cost"] = {"flops": float(cost.get("flops", 0.0)),
                   "bytes": float(cost.get("bytes accessed", 0.0))}  # fmt: skip
    text = compiled.as_text()
    if keep_hlo:
        row["hlo"] = text
    row["copies"] = hlo_ops.relayout_copies(text)
    chips = workload.chips
    row["collectives"] = [ici.collective_entry(op, chips) for op in hlo_ops.collectives(text)]
    if dump_dir is None:
        row["notes"].append("no LLO dump was requested: no static schedule")
        return row
    try:
        schedules = llo.load_dump(dump_dir, target.mxu_rows_per_cycle)
    except FileNotFoundError as exc:
        row["notes"].append(f"LLO dump missing: {exc}")
        return row
    calls = hlo_ops.kernel_calls(text)
    conditional = hlo_ops.conditional_kernel_calls(text)
    twins = hlo_ops.kernel_twins(calls, schedules)
    if subject.notes is not None:
        row["notes"] += subject.notes(workload)
    for call in calls:
        if call.name in twins:
            row["notes"].append(
                f"kernel {call.name} is the very kernel of {twins[call.name]} (libtpu compiled "
                "them once, one bundle dump): charged its schedule"
            )
        schedule = schedules.get(twins.get(call.name, call.name))
        if schedule is not None:
            trips = subject.loop_trips(workload, call.name) if subject.loop_trips else None
            entry = spread.kernel_entry(schedule, workload, trips) | {"name": call.name}
            if trips is not None and not entry["cycles_from"].startswith("loops whose"):
                row["notes"].append(
                    f"kernel {call.name}: its loops' trip counts ({trips}) could not be applied "
                    f"({'; '.join(entry['warnings'][-1:])}): each loop body is counted once per "
                    "grid step, a LOWER bound on its time"
                )
            if call.name in conditional:
                entry["runs"] = workload.runs_conditional_kernels
                if not entry["runs"]:
                    row["notes"].append(
                        f"kernel {call.name} sits in a conditional branch this workload never "
                        "takes (Workload.runs_conditional_kernels): not charged"
                    )
            row["kernels"].append(entry)
        else:
            row["notes"].append(f"no bundle dump for kernel {call.name}: no static schedule")
    row["other_ops"] = _other_ops(
        schedules, {call.name for call in calls}, {c["name"] for c in row["collectives"]}
    )
    if row["collectives"]:
        row["notes"].append(
            "collectives are modelled from their bytes and groups (the estimator's ici model), "
            "not from their schedules, whose waits on the interconnect have no static length"
        )
    if row["other_ops"]["undetermined"]:
        names = ", ".join(row["other_ops"]["undetermined"])
        row["notes"].append(f"ops with loops of unknown trip count, counted once: {names}")
    return row


def _other_ops(schedules: dict, kernel_names: set[str], collective_names: set[str]) -> dict:
    """Static cycles of every other op of the program (XLA fusions, copies, reductions), but
    its collectives.

    Ops whose loops have a trip count the schedule does not give are counted with each loop
    body run once, a lower bound, and listed as undetermined.
    """
    cycles, undetermined, counted = 0, [], 0
    for name, schedule in sorted(schedules.items()):  # by name: the dump's order varies
        if name in kernel_names or name in collective_names:
            continue
        counted += 1
        if schedule.executed_bundles_max is not None:  # MXU-bound ops: their busiest MXU
            cycles += max(schedule.executed_bundles_max, schedule.executed_mxu_cycles_max or 0)
        else:
            cycles += schedule.bundles
            undetermined.append(name)
    return {
        "ops": counted,
        "cycles": cycles,
        "undetermined": undetermined,
    }


def longest_fitting(subject, op: str, target, limit: int, step: int) -> dict:
    """The longest sequence (multiple of ``step``) whose program fits in HBM (`fit`)."""
    from pallas_flash_bench import aot
    from pallas_flash_bench.kernels.workloads import Workload
    from pallas_flash_bench.runs.fit import longest_fitting as search

    def total_bytes(n: int) -> int | None:
        """Total HBM bytes at length n if it compiles and fits, else None."""
        workload = Workload(op, n)
        fn = subject.build(workload, None)
        try:
            memory = aot.compile_for(fn, subject.arguments(workload), target).memory_analysis()
        except Exception:  # noqa: BLE001 - out of memory shows up as a compiler error too
            return None
        total = (
            memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
        )
        return total if total <= target.hbm_bytes else None

    result = {"subject": subject.id, "op": op, "longest_seq_len": None, "limit_searched": limit,
              "hbm_total_at_limit": None, "source": "compiler", "note": ""}  # fmt: skip
    if subject.build(Workload(op, step), None) is None:
        result["note"] = "unsupported"
        return result
    found = search(total_bytes, target.hbm_bytes, step, limit)
    result.update(longest_seq_len=found.longest or None, hbm_total_at_limit=found.total,
                  compiles=found.compiles)  # fmt: skip
    if found.longest >= limit:
        result["note"] = f"fits up to the searched limit {limit}"
    return result


@functools.cache
def _subjects(sweep: str, backends: tuple[str, ...] | None, references: bool) -> dict:
    """The run's subjects by id (`references.all_subjects`), built once per worker."""
    from pallas_flash_bench.kernels.references import all_subjects

    return all_subjects(sweep, None if backends is None else list(backends), references)


def _subject(job: dict):
    backends = None if job["backends"] is None else tuple(job["backends"])
    return _subjects(job["sweep"], backends, job["references"])[job["subject"]]


def _row_job(job: dict, target, dump_dir: pathlib.Path | None) -> dict | None:
    from pallas_flash_bench.kernels.workloads import Workload

    workload = Workload(**job["workload"])
    return analyse_row(_subject(job), workload, target, dump_dir, job.get("keep_hlo", False))


def _fit_job(job: dict, target, dump_dir: pathlib.Path | None) -> dict:
    return longest_fitting(_subject(job), job["op"], target, job["limit"], job["step"])


def _model_job(job: dict, target, dump_dir: pathlib.Path | None) -> dict:
    from pallas_flash_bench.models import model_steps, model_workloads

    return model_steps.analyse_model(model_workloads.ModelWorkload(**job["workload"]), dump_dir)


def _context_job(job: dict, target, dump_dir: pathlib.Path | None) -> dict:
    from pallas_flash_bench.context import context_steps, context_workloads

    context = context_workloads.ContextWorkload(**job["workload"])
    return context_steps.analyse_context(context, dump_dir)


def _program_job(job: dict, target, dump_dir: pathlib.Path | None) -> dict:
    from pallas_flash_estimate.aot import worker
    from pallas_flash_estimate.aot.program_ref import ProgramRef

    return worker.analyse(ProgramRef.from_json(job["program"]), target, dump_dir)


JOB_KINDS = {
    "row": _row_job,
    "fit": _fit_job,
    "model": _model_job,
    "context": _context_job,
    "program": _program_job,
}
"""A job's ``kind`` -> what runs it: ``(job, target, dump folder) -> result`` (None: the
subject does not support the workload)."""


def main(argv: list[str]) -> None:
    import jax

    from pallas_flash.tpu import GENERATION_ENV_VAR
    from pallas_flash_estimate.targets import TARGETS

    # Every job compiles: its figures come from the dumps a compile writes (and jax cannot
    # read a TPU executable compiled on a host without one back from its persistent cache).
    jax.config.update("jax_enable_compilation_cache", False)
    jobs = json.loads(pathlib.Path(argv[0]).read_text())
    dump_dir = pathlib.Path(argv[1]) if len(argv) > 1 else None
    for job in jobs:
        target = TARGETS[job["target"]]
        os.environ[GENERATION_ENV_VAR] = target.generation  # kernels sized for the target
        try:
            result = JOB_KINDS[job["kind"]](job, target, dump_dir)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next job
            result = {"job_error": _error_text(exc), "traceback": traceback.format_exc()}
        print(RESULT_PREFIX + json.dumps({"job": job["id"], "result": result}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PALLAS_FLASH_INTERPRET", "0")  # emit Mosaic kernels for the TPU
    main(sys.argv[1:])
