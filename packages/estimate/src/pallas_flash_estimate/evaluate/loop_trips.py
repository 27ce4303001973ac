"""A kernel's executed bundles when some of its loops have trip counts read from memory.

A ``while`` loop whose condition reads memory (jax's ``ragged_paged_attention`` walks the
sequences of a query block and, per sequence, its kv blocks, both up to lengths in SMEM) has no
trip count in its schedule, and a static count runs its body once. The bench knows the
workload's lengths, so a subject can say how often each such loop runs over the whole kernel
(the bench's ``Subject.loop_trips``): `bundle_counts` then gives every bundle its
executions,

- outside every loop: once (a predicated region outside the loops: 0 in the min);
- in a loop of constant trip count: its trip count times its parent loop's executions, and in
  a predicated region of that loop decided by the loop's evaluation
  (`Region.executed_iterations`) that many iterations (scaled likewise); undecided: 0 (min)
  or every iteration (max);
- in a loop without one: the executions the subject gave it (the dynamic loops in program
  order: outermost first when they nest, and loops side by side in one loop, as RPA v3's cache
  writes beside its compute chunks, in the order they start), a predicated region of that
  loop 0 (min) or every iteration (max).

Any per-bundle figure (executed bundles, each MXU's ``vmatmul`` cycles, the critical path) is
then the sum of its weights times these counts (`weigh`). No JAX import: this module only reads
text.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pallas_flash_estimate.evaluate.bundle_listing import BundleListing, Loop

__all__ = ["BundleCounts", "bundle_counts", "busiest", "instruction_runs", "weigh"]

BundleCounts = tuple[list[int], list[int]]
"""Per bundle, its executions over the whole kernel: undecided regions skipped, and run."""


def _innermost(loops: Sequence[Loop], index: int) -> Loop | None:
    inside = [lp for lp in loops if lp.start <= index <= lp.end]
    return min(inside, key=lambda lp: lp.bundles) if inside else None


def bundle_counts(listing: BundleListing, trips: Sequence[int]) -> BundleCounts | str:
    """Executions of every bundle (module doc), the loops without a trip count running
    ``trips`` times over the whole kernel, in program order (outermost first); or why they
    cannot be counted: not as many such loops as ``trips``."""
    loops = listing.loops
    dynamic = sorted((lp for lp in loops if lp.trip_count is None),
                     key=lambda lp: (lp.start, lp.depth))  # fmt: skip
    if len(dynamic) != len(trips):
        return f"{len(dynamic)} loops without a trip count, {len(trips)} trip counts given"
    given = {lp.start: n for lp, n in zip(dynamic, trips, strict=True)}
    runs: dict[int, int] = {}  # loop start -> executions of its body over the kernel
    for lp in sorted(loops, key=lambda lp: lp.depth):
        if lp.start in given:
            runs[lp.start] = given[lp.start]
            continue
        parent = _innermost([p for p in loops if p is not lp and p.depth < lp.depth], lp.start)
        assert lp.trip_count is not None
        runs[lp.start] = lp.trip_count * (runs[parent.start] if parent else 1)

    n = len(listing.bundles)
    lo, hi = [0] * n, [0] * n
    owner = {r.branch: _innermost(loops, r.branch) for r in listing.regions}
    for index in range(n):
        loop = _innermost(loops, index)
        base = runs[loop.start] if loop else 1
        per_iteration = base // loop.trip_count if loop and loop.trip_count else None
        mine = [r for r in listing.regions if r.start <= index <= r.end and owner[r.branch] is loop]
        decided = [r.executed_iterations for r in mine if r.executed_iterations is not None]
        top = base
        if decided and per_iteration is not None:
            top = min(decided) * per_iteration  # nested regions count their parents' skips
        hi[index] = top
        lo[index] = top if len(decided) == len(mine) else 0
    return lo, hi


def weigh(counts: BundleCounts, prefix: Sequence[int]) -> tuple[int, int]:
    """(min, max) of a per-bundle weight (given as `bundle_weights.prefix_sums`) over the
    kernel's executions."""
    lo, hi = counts
    weights = [b - a for a, b in itertools.pairwise(prefix)]
    return (
        sum(c * w for c, w in zip(lo, weights, strict=True)),
        sum(c * w for c, w in zip(hi, weights, strict=True)),
    )


def busiest(counts: BundleCounts, prefixes: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(min, max) of the busiest of several per-bundle weights (each MXU's) over the kernel."""
    weighed = [weigh(counts, p) for p in prefixes]
    return max((w[0] for w in weighed), default=0), max((w[1] for w in weighed), default=0)


def instruction_runs(counts: BundleCounts, index: int, guard: str | None) -> tuple[int, int]:
    """(min, max) runs of an instruction of bundle ``index``; one with a predicate (``guard``)
    is taken to be skipped (min) or to run (max) whenever its bundle runs."""
    lo, hi = counts
    return (0 if guard is not None else lo[index]), hi[index]
