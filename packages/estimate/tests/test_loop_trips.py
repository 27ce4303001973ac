"""`loop_trips.bundle_counts`: loops without a trip count given their runs in program order,
nested ones outermost first and loops side by side in one loop in the order they start."""

from __future__ import annotations

from types import SimpleNamespace

from pallas_flash_estimate.evaluate.bundle_listing import Loop
from pallas_flash_estimate.evaluate.loop_trips import bundle_counts


def _listing(loops: list[Loop], bundles: int) -> SimpleNamespace:
    return SimpleNamespace(loops=tuple(loops), bundles=(None,) * bundles, regions=())


def test_nested_loops_take_their_runs_outermost_first() -> None:
    outer, inner = Loop(1, 8, 1, None, 0), Loop(3, 6, 2, None, 0)
    lo, hi = bundle_counts(_listing([inner, outer], 10), (4, 12))
    assert lo == hi == [1, 4, 4, 12, 12, 12, 12, 4, 4, 1]


def test_loops_side_by_side_take_theirs_in_the_order_they_start() -> None:
    # a loop over kv blocks holding a short write loop, then the compute loop
    blocks, writes, chunks = Loop(1, 10, 1, None, 0), Loop(2, 3, 2, None, 0), Loop(5, 8, 2, None, 0)
    lo, hi = bundle_counts(_listing([chunks, blocks, writes], 12), (5, 2, 9))
    assert lo == hi == [1, 5, 2, 2, 5, 9, 9, 9, 9, 5, 5, 1]
    # a constant loop inside one of them runs its trips times that loop's runs
    fixed = Loop(6, 7, 3, 3, 0)
    lo, _ = bundle_counts(_listing([blocks, writes, chunks, fixed], 12), (5, 2, 9))
    assert lo[6:8] == [27, 27] and lo[5] == 9


def test_as_many_runs_as_such_loops_are_needed() -> None:
    loops = [Loop(1, 8, 1, None, 0), Loop(3, 6, 2, None, 0)]
    assert bundle_counts(_listing(loops, 10), (4,)) == (
        "2 loops without a trip count, 1 trip counts given"
    )
