"""``--every-nth-case N`` (`pallas_flash_conformance.case_share`): each parametrized test keeps
its first case and every N-th after it, counting the cases that are not marked to skip."""

from __future__ import annotations

import pathlib
import subprocess
import sys

TESTS = """
import pytest

@pytest.mark.parametrize("n", [0, 1, pytest.param(2, marks=pytest.mark.skip), 3, 4, 5, 6, 7])
def test_numbers(n):
    pass

@pytest.mark.parametrize("x", [pytest.param("a", marks=pytest.mark.skipif(True, reason="")), "b"])
def test_letters(x):
    pass

def test_alone():
    pass
"""


def _collected(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_cases.py").write_text(TESTS)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", *args, "test_cases.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _ids(done: subprocess.CompletedProcess) -> list[str]:
    return [line.split("::")[1] for line in done.stdout.splitlines() if "::" in line]


def test_every_third_case_of_each_test_and_every_skipped_one(tmp_path) -> None:
    done = _collected(tmp_path, "--every-nth-case", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    # numbers: 0, 1, 3, 4, 5, 6, 7 are the cases that run; the 1st, 4th and 7th of them stay
    assert _ids(done) == [
        "test_numbers[0]", "test_numbers[2]", "test_numbers[4]", "test_numbers[7]",
        "test_letters[a]", "test_letters[b]", "test_alone",
    ]  # fmt: skip
    assert "4 deselected" in done.stdout


def test_every_case_by_default(tmp_path) -> None:
    assert len(_ids(_collected(tmp_path))) == 11
    assert len(_ids(_collected(tmp_path, "--every-nth-case", "1"))) == 11


def test_a_share_below_one_is_refused_by_name(tmp_path) -> None:
    done = _collected(tmp_path, "--every-nth-case", "0")
    assert done.returncode != 0
    assert "--every-nth-case must be at least 1, got 0" in done.stderr
