"""The pool of compile workers: jobs run in subprocesses (`pallas_flash_bench.runs.worker`), whose
libtpu writes its LLO dump where the job needs one."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

from tqdm import tqdm

from pallas_flash_bench.runs.cache import ResultCache
from pallas_flash_estimate.aot.worker import RESULT_PREFIX, dump_env

WHOLE_PROGRAMS = ("model", "context", "program")
"""Job kinds that compile a whole program, the longest compiles: each worker starts on its
share of them."""


def run_cached(
    jobs: list[dict], versions: dict, cache: ResultCache, workers: int, desc: str,
    *, compile_missing: bool = True,
) -> dict[int, dict | None]:  # fmt: skip
    """Each job's result by id: from ``cache``, else run in workers (with ``compile_missing``,
    else left out) and cached as it arrives, so that a run stopped midway keeps what it
    compiled. A result is None where the subject does not support the workload, which is
    cached too (a cached run starts no worker); a job error is not."""
    results: dict[int, dict | None] = {}
    todo, keys = [], {}
    for job in jobs:
        key = ResultCache.key(job, versions)
        if cache.holds(key):
            results[job["id"]] = cache.get(key)
        elif compile_missing:
            todo.append(job)
            keys[job["id"]] = key

    def keep(job_id: int, result: dict | None) -> None:
        if result is None or "job_error" not in result:
            cache.put(keys[job_id], result)

    with tqdm(total=len(jobs), initial=len(results), desc=desc, unit="job") as progress:
        fresh = run_workers(todo, workers, progress, on_result=keep)
    return results | fresh


def run_workers(
    jobs: list[dict],
    workers: int,
    progress: tqdm,
    on_result: Callable[[int, dict | None], None] | None = None,
) -> dict[int, dict | None]:
    """Runs jobs in worker processes (rows with LLO dumps, fits without); returns results by
    id, each also given to ``on_result`` (job id, result) as it arrives. The scratch folder
    (job lists, dumps, logs) is removed, or only its dumps when a worker exited early (its
    logs say why)."""
    results: dict[int, dict | None] = {}
    if not jobs:
        return results
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="pallas-flash-bench-"))
    # whole programs are the longest compiles: each worker starts on its share of them
    rows = [j for j in jobs if j["kind"] in WHOLE_PROGRAMS]
    rows += [j for j in jobs if j["kind"] == "row"]
    fits = [j for j in jobs if j["kind"] == "fit"]
    groups = [(rows[i::workers], True) for i in range(workers)] + [(fits, False)]
    lines: queue.Queue[str | None] = queue.Queue()
    processes = []
    for index, (group, dump) in enumerate(groups):
        if not group:
            continue
        jobs_file = scratch / f"jobs-{index}.json"
        jobs_file.write_text(json.dumps(group))
        # Several compile workers run at once: libtpu's lock file would refuse all but one.
        env = dict(os.environ, PALLAS_FLASH_INTERPRET="0", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        args = [sys.executable, "-m", "pallas_flash_bench.runs.worker", str(jobs_file)]
        if dump:
            dump_dir = scratch / f"dump-{index}"
            env = dump_env(dump_dir, env)
            args.append(str(dump_dir))
        log = open(scratch / f"worker-{index}.log", "w")  # noqa: SIM115 - closed below
        process = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        processes.append((process, log))
        threading.Thread(target=_forward_lines, args=(process, lines), daemon=True).start()
    finished = 0
    while finished < len(processes):
        line = lines.get()
        if line is None:
            finished += 1
            continue
        message = json.loads(line[len(RESULT_PREFIX) :])
        results[message["job"]] = message["result"]
        if on_result is not None:
            on_result(message["job"], message["result"])
        progress.update(1)
    for process, log in processes:
        process.wait()
        log.close()
    missing = [j for j in jobs if j["id"] not in results]
    for job in missing:
        results[job["id"]] = {"job_error": f"worker exited early; see logs in {scratch}"}
    for dump in scratch.glob("dump-*"):  # gigabytes of listings, read by now
        shutil.rmtree(dump, ignore_errors=True)
    if not missing:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def _forward_lines(process: subprocess.Popen, lines: queue.Queue) -> None:
    for line in process.stdout:
        if line.startswith(RESULT_PREFIX):
            lines.put(line.strip())
    lines.put(None)
