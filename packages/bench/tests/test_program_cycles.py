"""The whole program's static cycles: Pallas kernels plus every XLA op around them."""

from __future__ import annotations

from pallas_flash_bench.runner import program_cycles


def _row(kernels: list[int], other: dict | None) -> dict:
    return {"kernels": [{"cycles": c} for c in kernels], "other_ops": other}


def test_kernels_and_other_ops_add_up() -> None:
    row = _row([900, 100], {"ops": 3, "cycles": 50, "undetermined": []})
    assert program_cycles(row) == 1050


def test_kernel_programs_count_undetermined_ops_at_their_lower_bound() -> None:
    row = _row([900], {"ops": 1, "cycles": 50, "undetermined": ["copy.3"]})
    assert program_cycles(row) == 950


def test_xla_programs_with_undetermined_ops_have_no_static_figure() -> None:
    assert program_cycles(_row([], {"ops": 2, "cycles": 50, "undetermined": ["copy.3"]})) is None
    assert program_cycles(_row([], {"ops": 2, "cycles": 50, "undetermined": []})) == 50


def test_without_a_dump_only_kernels_count() -> None:
    assert program_cycles(_row([], None)) is None
    assert program_cycles(_row([7], None)) == 7
