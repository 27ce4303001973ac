"""A kernel's headline cycles from its executed bundles and busiest MXU, and the share of its
grid on which the regions its schedule cannot decide run."""

from __future__ import annotations

from pallas_flash_estimate.cost import kernel_cost


def test_causal_active_fraction_of_square_blocks_is_the_lower_triangle() -> None:
    assert kernel_cost.causal_active_fraction(8, 8) == 36 / 64
    assert kernel_cost.causal_active_fraction(1, 1) == 1.0


def test_causal_active_fraction_with_longer_kv_blocks() -> None:
    # 4 query blocks x 2 kv blocks over a square mask: kv block 1 starts at half the keys,
    # so query blocks 0 and 1 (the first half of the queries) do not touch it.
    assert kernel_cost.causal_active_fraction(4, 2) == 6 / 8


def test_kernel_cycles_when_every_region_is_decided() -> None:
    assert kernel_cost.kernel_cycles(1_469_086, 1_469_086, 9, (1, 16, 8, 8), causal=True) == (
        1_469_086,
        "every predicated region decided",
    )


def test_undecided_regions_between_their_bounds() -> None:
    assert kernel_cost.undecided_fraction((16, 4, 4), causal=True) == 10 / 16
    assert kernel_cost.undecided_fraction((16, 4, 4), causal=False) == 1.0
    assert kernel_cost.undecided_fraction(None, causal=True) == 1.0
    # splash's critical path: its block-mask region (4,292 cycles) on 160 of 256 steps
    assert kernel_cost.between((17_141, 1_115_893), 10 / 16) == 17_141 + 160 * 4292
    assert kernel_cost.between((0, 3), 0.5) == 2  # rounded up
    assert kernel_cost.between(None, 0.5) is None


def test_undecided_regions_run_on_the_causal_fraction_of_steps() -> None:
    cycles, how = kernel_cost.kernel_cycles(1000, 2000, 9, (1, 4, 8, 8), causal=True)
    assert cycles == 1000 + 1000 * 36 // 64 + 1  # ceil of 562.5
    assert "56%" in how


def test_undecided_regions_all_run_without_a_causal_mask() -> None:
    assert kernel_cost.kernel_cycles(1000, 2000, 9, (1, 4, 8, 8), causal=False)[0] == 2000


def test_an_mxu_bound_kernel_takes_its_busiest_mxus_cycles() -> None:
    cycles, how = kernel_cost.kernel_cycles(1000, 1000, 9, (1, 4, 8, 8), False, 1200, 1200)
    assert cycles == 1200
    assert "MXU-bound: the busiest MXU needs 1200 cycles for 1000 bundles" in how
    assert kernel_cost.kernel_cycles(1000, 1000, 9, (1, 4, 8, 8), False, 800, 800)[0] == 1000


def test_kernel_cycles_fall_back_to_steps_times_bundles() -> None:
    assert kernel_cost.kernel_cycles(None, None, 1620 * 1024, None, causal=False) == (
        1620 * 1024,
        "grid steps x bundles per step",
    )


def test_a_kernel_the_estimator_knows_nothing_of_runs_its_whole_grid() -> None:
    grid = (1, 4, 8, 8)
    assert kernel_cost.undecided_fraction(grid, False, kernel_cost.FULL_GRID) == 1.0
    assert kernel_cost.copied_fraction("any_kernel.1", grid, kernel_cost.FULL_GRID) == 1.0
    assert (
        kernel_cost.kernel_cycles(1000, 2000, 9, grid, False, None, None, kernel_cost.FULL_GRID)[0]
        == 2000
    )
