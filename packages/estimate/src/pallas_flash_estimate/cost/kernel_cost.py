"""One Pallas kernel's cycles from its static schedule, and how much of its grid a call uses.

The schedule gives a kernel's executed bundles and its busiest MXU's cycles with the regions
it cannot decide (a predicate read from memory, such as splash attention's block mask)
skipped and run: `kernel_cycles` takes the share of the grid steps on which they run
(`undecided_fraction`) from what the estimator knows of the call, its `Occupancy`.

No JAX import.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol


class Occupancy(Protocol):
    """What the estimator needs to know of a kernel call beyond its listing: whether a causal
    mask skips blocks, and for a call whose blocks hold data only in part (a decode of ragged
    lengths) which blocks, and which of its bytes, it reads. `FullGrid` knows nothing more
    than the listing; the bench's workloads know their lengths."""

    @property
    def causal(self) -> bool: ...

    def filled_fraction(self, grid: tuple[int, ...] | None) -> float | None:
        """For a call that skips the blocks past its data: the share of the ``grid``'s steps
        whose block holds data (1.0 where the grid does not show which); None for any other
        call."""
        ...

    def copied_fraction(self, kernel: str) -> float | None:
        """The share of its operands' bytes the kernel named ``kernel`` reads, where the call
        knows it (a kernel that copies only the pages holding a token); None otherwise."""
        ...


@dataclasses.dataclass(frozen=True)
class FullGrid:
    """The occupancy of a kernel the estimator knows nothing about (any user's kernel): no
    mask skips a block, every region the schedule cannot decide runs on every grid step, and
    every block it copies is read. ``loop_trips``: for a kernel whose loops' trip counts
    read memory (a grid sized at run time), how often each runs over the whole kernel,
    outermost first (`spread.kernel_entry`); None: each runs once. ``copied``: the share of
    its operands' bytes it reads, where the caller knows it (a ragged kernel that copies only
    the pages its sequences hold); None: all."""

    causal: bool = False
    loop_trips: tuple[int, ...] | None = None
    copied: float | None = None

    def filled_fraction(self, grid: tuple[int, ...] | None) -> float | None:
        return None

    def copied_fraction(self, kernel: str) -> float | None:
        return self.copied


FULL_GRID = FullGrid()


def causal_active_fraction(q_blocks: int, kv_blocks: int) -> float:
    """Fraction of a ``q_blocks x kv_blocks`` grid over a square causal mask that holds at least
    one visible score: block ``(i, j)`` is active iff ``j / kv_blocks < (i + 1) / q_blocks``."""
    active = sum(
        1 for i in range(q_blocks) for j in range(kv_blocks) if j * q_blocks < (i + 1) * kv_blocks
    )
    return active / (q_blocks * kv_blocks)


def undecided_fraction(
    grid: tuple[int, ...] | None, causal: bool, occupancy: Occupancy | None = None
) -> float:
    """Fraction of the grid steps taken to run a region the schedule cannot decide (its
    predicate reads memory, like splash attention's block mask): the steps a causal mask
    leaves active; for a call whose blocks hold data in part, the steps whose block does
    (`Occupancy.filled_fraction`); all of them otherwise."""
    if causal and grid is not None and len(grid) >= 2:
        return causal_active_fraction(grid[-2], grid[-1])
    filled = occupancy.filled_fraction(grid) if occupancy is not None else None
    return 1.0 if filled is None else filled


def copied_fraction(name: str, grid: tuple[int, ...] | None, occupancy: Occupancy | None) -> float:
    """Fraction of its operands' bytes the kernel ``name`` reads: what the call says
    (`Occupancy.copied_fraction`), else the whole blocks its data fills (`undecided_fraction`,
    no causal skipping), else all."""
    copied = occupancy.copied_fraction(name) if occupancy is not None else None
    return undecided_fraction(grid, False, occupancy) if copied is None else copied


def between(bounds: tuple[int, int] | None, fraction: float) -> int | None:
    """``min + fraction x (max - min)`` of a (regions skipped, regions run) pair, rounded up."""
    if bounds is None:
        return None
    lo, hi = bounds
    return lo + math.ceil((hi - lo) * fraction)


def kernel_cycles(
    executed_min: int | None,
    executed_max: int | None,
    fallback: int,
    grid: tuple[int, ...] | None,
    causal: bool,
    mxu_min: int | None = None,
    mxu_max: int | None = None,
    occupancy: Occupancy | None = None,
) -> tuple[int, str]:
    """Headline static cycles of one kernel and how they were obtained.

    One bundle issues per cycle, but a ``vmatmul`` keeps its MXU busy for several cycles
    (`bundle_weights.mxu_cycles`); the kernel takes the larger of its bundles and its
    busiest MXU's cycles (weight pushes free: see `spread` for the other estimates).

    ``executed_min`` / ``executed_max`` are the bundles the kernel executes with its undecided
    predicated regions skipped / run (equal when the schedule decides every region, e.g. a
    block skip computed from the grid indices), ``mxu_min`` / ``mxu_max`` the busiest MXU's
    cycles likewise. When they differ, the regions run on `undecided_fraction` of the steps.
    Without the bundle figures (inner loops, unknown trip count), ``fallback`` is used: grid
    steps x bundles per step, every region run; for a decode of ragged lengths, only on the
    steps whose block holds a cached token (the others counted free: the kernel's benefit).
    """
    if executed_min is None or executed_max is None:
        fraction = undecided_fraction(grid, False, occupancy)
        if fraction < 1.0:
            return math.ceil(fallback * fraction), (
                f"grid steps x bundles per step on the {fraction:.0%} of steps whose block "
                "holds a cached token (the others counted free)"
            )
        return fallback, "grid steps x bundles per step"
    fraction = 1.0
    if executed_min == executed_max and mxu_min == mxu_max:
        how = "every predicated region decided"
    else:
        fraction = undecided_fraction(grid, causal, occupancy)
        how = f"data-dependent regions run on {fraction:.0%} of the steps"
    cycles = between((executed_min, executed_max), fraction)
    assert cycles is not None
    if mxu_min is not None and mxu_max is not None:
        mxu = between((mxu_min, mxu_max), fraction)
        assert mxu is not None
        if mxu > cycles:
            how += f"; MXU-bound: the busiest MXU needs {mxu} cycles for {cycles} bundles"
            cycles = mxu
    return cycles, how
