"""What several bench test modules share."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from tqdm import tqdm

from pallas_flash_bench.kernels.subjects import Subject
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_bench.runs.workers import run_workers


@pytest.fixture
def run_row() -> Callable[[Subject, Workload], dict]:
    """Compiles and analyses one reference row for one v5e chip in a compile worker, as a
    quick run does; returns the row."""

    def run(subject: Subject, workload: Workload) -> dict:
        job = {"id": 0, "kind": "row", "subject": subject.id, "workload": workload.to_json(),
               "sweep": "quick", "backends": [], "references": True, "target": "v5e-1"}  # fmt: skip
        with tqdm(total=1, disable=True) as progress:
            return run_workers([job], 1, progress)[0]

    return run
