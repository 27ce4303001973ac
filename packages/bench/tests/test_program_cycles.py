"""The whole program's static cycles: Pallas kernels plus every XLA op around them."""

from __future__ import annotations

import pytest

from pallas_flash_bench.kernels.row_figures import SPREAD
from pallas_flash_bench.runs.runner import program_cycles, program_estimates
from pallas_flash_estimate.targets import TARGETS


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


def _estimated(cycles: int, dma_bytes: int | None, **estimates: int) -> dict:
    return {"cycles": cycles, "dma_bytes": dma_bytes, "estimates": estimates}


def test_program_estimates_add_the_other_ops_to_each_kernel_estimate() -> None:
    target = TARGETS["v5e-1"]
    a = _estimated(900, 64 << 20, schedule=800, mxu=900, critical_path=950, push8=1000,
                   push16=1200)  # fmt: skip
    b = _estimated(100, None, schedule=100, mxu=50, critical_path=90, push8=100, push16=100)
    row = {"kernels": [a, b], "other_ops": {"ops": 1, "cycles": 7, "undetermined": []}}
    out = program_estimates(row, target)
    assert list(out) == list(SPREAD)
    assert out["schedule"] == 907 and out["mxu"] == 957 and out["critical_path"] == 1047
    assert out["push8"] == 1107 and out["push16"] == 1307
    assert out["dma"] is None  # the second kernel has no DMA figure
    b["dma_bytes"] = 0
    dma = (64 << 20) / target.hbm_bandwidth * target.clock_hz  # above a's 900 cycles
    assert program_estimates(row, target)["dma"] == pytest.approx(dma + 100 + 7, abs=1)


def test_program_estimates_need_every_kernel_and_a_kernel() -> None:
    target = TARGETS["v5e-1"]
    row = {"kernels": [{"cycles": 5}], "other_ops": None}  # a row from an older worker
    assert set(program_estimates(row, target).values()) == {None}
    assert set(program_estimates({"kernels": [], "other_ops": None}, target).values()) == {None}


def test_a_kernel_that_cannot_hide_its_copies_gets_a_note() -> None:
    from pallas_flash_bench.runs.runner import _dma_notes

    target = TARGETS["v5e-1"]
    hidden = {"name": "pallas_flash_forward.1", "cycles": 1_074_041, "dma_bytes": 64 << 20,
              "steps": 64}  # fmt: skip
    exposed = {**hidden, "name": "decode.1", "cycles": 1000}
    assert _dma_notes({"kernels": [hidden, {"cycles": 5}]}, target) == []
    (note,) = _dma_notes({"kernels": [hidden, exposed]}, target)
    ratio = (64 << 20) / target.hbm_bandwidth * target.clock_hz / 1000
    assert note == (
        f"decode.1: its block copies need {ratio:.2f}x its compute "
        f"({64 << 20} bytes at most over 64 steps): DMA-bound"
    )
