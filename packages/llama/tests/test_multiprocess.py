"""``pallas-flash-llama`` as a job of several processes on localhost (`distributed`).

Each process is started as a user would start one host of a slice: the same command with
``--coordinator``, ``--num-processes`` and ``--process-id``; jax's coordination service and
gloo collectives connect them. A job of 2 processes with 2 CPU devices each, or of 4 with one
each, runs the same program over the same 4-device mesh as 1 process with 4 devices, so they
must agree.

The tests check what a job computes and what the CLI itself reports, never what the libraries
under it print: gloo, for one, writes lines of its own to a process's stdout, whether it does
depending on how the processes happen to connect.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from pallas_flash_conformance.across_processes import coordinator_address
from pallas_flash_llama import tiny
from pallas_flash_llama.weights import load_params

DEVICES = 4
TIMEOUT_S = 900
"""A bound on a hung job: one job takes 1 to 3 minutes on a loaded 2-core machine."""
TRAIN = ["--batch-size", "4", "--seq-len", "64", "--backend", "xla", "--mesh", "1,-1,1"]
CLI_REPORT = re.compile(r"resuming at step \d+ from |saved to |'.*' -> '.*'$")
"""The lines `pallas_flash_llama.cli` writes to stdout: a resumed run, saved weights, one
prompt's generated text (``'prompt' -> 'text'``)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("multiprocess") / "tiny"
    tiny.init_tiny(directory)
    return directory


def _start(args: list[str], processes: int, cache: pathlib.Path) -> list[subprocess.Popen]:
    """``pallas-flash-llama ARGS`` as a job of ``processes`` processes sharing 4 devices."""
    env = os.environ | {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES // processes}",
    }
    job = ["--coordinator", coordinator_address(), "--num-processes", str(processes)]
    command = [sys.executable, "-m", "pallas_flash_llama.cli", "--compilation-cache", str(cache)]
    return [
        subprocess.Popen(
            [*command, *((*job, "--process-id", str(rank)) if processes > 1 else ()), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(processes)
    ]


def _run(args: list[str], processes: int, cache: pathlib.Path) -> list[list[str]]:
    """Runs the job to the end; the lines each process's CLI reported (`CLI_REPORT`)."""
    reports = []
    for rank, process in enumerate(_start(args, processes, cache)):
        out, err = process.communicate(timeout=TIMEOUT_S)
        assert process.returncode == 0, f"process {rank} of {processes} failed:\n{err[-4000:]}"
        reports.append([line for line in out.splitlines() if CLI_REPORT.match(line)])
    return reports


def _losses(metrics: pathlib.Path) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def test_training_over_two_processes_matches_one_and_resumes_on_two_or_one(model, tmp_path) -> None:
    """2 processes of 2 devices each train 2 steps and checkpoint; the job resumes on 2
    processes and on 1 of 4 devices, and every loss and the saved weights equal 1 process's.
    (4 processes of one device each: the generation test.)"""
    cache = tmp_path / "cache"
    data = ["--model", str(model), "--data", str(model / tiny.SAMPLE_FILE), *TRAIN]
    _run(["train", *data, "--steps", "4", "--metrics", str(tmp_path / "one.jsonl")], 1, cache)
    one = _losses(tmp_path / "one.jsonl")

    # every process feeds two rows of the global batch
    first = ["--steps", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2"]
    _run(["train", *data, *first, "--metrics", str(tmp_path / "two.jsonl")], 2, cache)
    two = _losses(tmp_path / "two.jsonl")
    assert sorted(two) == [1, 2]
    np.testing.assert_allclose([two[1], two[2]], [one[1], one[2]], rtol=1e-5)

    shutil.copytree(tmp_path / "ck", tmp_path / "ck-for-one")
    for processes, checkpoints in ((2, "ck"), (1, "ck-for-one")):
        resumed = tmp_path / f"resumed-{processes}.jsonl"
        args = ["--steps", "4", "--checkpoint-dir", str(tmp_path / checkpoints)]
        saved = ["--metrics", str(resumed), "--save", str(tmp_path / f"model-{processes}")]
        reports = _run(["train", *data, *args, *saved], processes, cache)
        assert reports[0] == [
            f"resuming at step 2 from {tmp_path / checkpoints}",
            f"saved to {tmp_path / f'model-{processes}'}",
        ]
        assert not any(reports[1:]), "only process 0 reports"
        losses = _losses(resumed)
        assert sorted(losses) == [3, 4], processes
        np.testing.assert_allclose([losses[3], losses[4]], [one[3], one[4]], rtol=1e-5)
    _, by_two = load_params(tmp_path / "model-2")
    _, by_one = load_params(tmp_path / "model-1")
    for a, b in zip(jax.tree.leaves(by_two), jax.tree.leaves(by_one), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_generation_over_four_processes_matches_one(model, tmp_path) -> None:
    """4 processes of one device each give 1 process's tokens (2 processes of 2 devices: the
    training test)."""
    prompts = [arg for text in ("The", "Once", "A", "In") for arg in ("--prompt", text)]
    args = ["generate", "--model", str(model), *prompts, "--max-new-tokens", "6",
            "--backend", "xla", "--mesh", "1,-1,1", "--decode-backend", "splitkv",
            "--kv-cache", "paged"]  # fmt: skip
    one = _run(args, 1, tmp_path / "cache")
    four = _run(args, 4, tmp_path / "cache")
    assert len(one[0]) == 4 and four[0] == one[0]
    assert not any(four[1:]), "only process 0 reports"


def test_a_process_that_dies_stops_the_others(model, tmp_path) -> None:
    """Process 1 killed after the first step: process 0 exits non-zero, it does not hang.

    Which of two ends comes first depends on timing, so neither's text is checked: the CLI's
    own error (a collective with the dead process failed) or jax's coordination service
    ending the process (a task stopped answering within the heartbeat timeout)."""
    metrics = tmp_path / "metrics.jsonl"
    args = ["--heartbeat-timeout", "10", "train", "--model", str(model),
            "--data", str(model / tiny.SAMPLE_FILE), *TRAIN, "--steps", "100000",
            "--metrics", str(metrics)]  # fmt: skip
    main, other = _start(args, 2, tmp_path / "cache")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (metrics.exists() and metrics.read_text()):
            assert main.poll() is None and time.monotonic() < deadline, "no step was taken"
            time.sleep(0.5)
        other.kill()
        _, err = main.communicate(timeout=TIMEOUT_S)  # a hang fails here
    finally:
        for process in (main, other):
            process.kill()
    assert main.returncode != 0, err[-3000:]
