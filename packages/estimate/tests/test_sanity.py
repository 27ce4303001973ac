"""The estimate held against its ops' flops (`program.sanity`): a loop counted too few or
too many times gives no figure."""

from __future__ import annotations

import pytest

from pallas_flash_estimate.program import sanity

PEAK = 197e12  # v5e's bf16 FLOP/s
FLOPS = 197e9  # 1 ms at peak


def test_an_op_between_its_flop_floor_and_its_mxu_ceiling_is_plausible() -> None:
    assert sanity.implausible("k", 1.2e-3, 1.1e-3, FLOPS, PEAK) is None
    # a causal kernel declaring the full grid's flops, half of them skipped
    assert sanity.implausible("k", 0.6e-3, 0.55e-3, FLOPS, PEAK) is None
    # a kernel bound by its softmax, its MXUs half idle
    assert sanity.implausible("k", 4e-3, 1e-3, FLOPS, PEAK) is None


def test_an_op_that_declares_no_flops_is_held_to_nothing() -> None:
    assert sanity.implausible("write", 1e-9, 5.0, None, PEAK) is None
    assert sanity.implausible("write", 1e-9, 5.0, 0, PEAK) is None


def test_loops_counted_once_put_an_op_under_its_flop_floor() -> None:
    """tokamax's grouped matmul with its grid's loop counted once read 0.18 of its measured
    time on v5p: under half its flops at peak."""
    found = sanity.implausible("gmm.1", 0.18e-3, 0.18e-3, FLOPS, PEAK)
    assert found is not None
    assert found.startswith("gmm.1: estimated 0.18 ms") and "too few times" in found


def test_a_placeholder_trip_count_puts_an_op_over_its_mxu_ceiling() -> None:
    """A grid sized at run time charged a placeholder's 2^31 steps: its MXU busy for days."""
    found = sanity.implausible("splash.1", 4.8e5, 4.0e5, FLOPS, PEAK)
    assert found is not None and "too many times" in found
    limit = sanity.MXU_WASTE * FLOPS / PEAK
    assert sanity.implausible("k", 2 * limit, limit, FLOPS, PEAK) is None
    assert sanity.implausible("k", 2 * limit, 1.01 * limit, FLOPS, PEAK) is not None


@pytest.mark.parametrize("share", [0.49, 0.5])
def test_the_floor_is_half_the_flops_at_peak(share: float) -> None:
    found = sanity.implausible("k", share * FLOPS / PEAK, None, FLOPS, PEAK)
    assert (found is not None) == (share < sanity.FLOOR_SHARE)
