"""The longest sequence that fits in HBM, found with as few compiles as the memory's shape allows.

A program's HBM use is, up to padding, a polynomial of degree at most two in the sequence
length (inputs and outputs grow linearly, a materialised score matrix quadratically). So the
search compiles three short lengths, fits the quadratic through their totals, and predicts
the crossing with the capacity; then it checks the prediction and its next step, and only
where the prediction is off does it gallop and bisect from there. Either way the answer is
what the compiler said: a length that fits whose next step does not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

PROBES = (4, 8, 16)
"""The lengths, in steps, whose totals the prediction is fitted through."""


@dataclasses.dataclass
class Search:
    """The search's result: ``longest`` (a multiple of the step; 0 if even one step does not
    fit), its HBM total, and how many lengths were compiled."""

    longest: int
    total: int | None
    compiles: int


def predict(points: list[tuple[int, int]], capacity: int) -> float | None:
    """The largest length at which the quadratic through three ``(length, total)`` points
    reaches ``capacity``; None when the totals do not grow with the length."""
    (x0, y0), (x1, y1), (x2, y2) = points
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    a = (d12 - d01) / (x2 - x0)
    b = d01 - a * (x0 + x1)
    c = y0 - a * x0 * x0 - b * x0
    if a > 0:
        return (-b + math.sqrt(b * b - 4 * a * (c - capacity))) / (2 * a)
    if b > 0:  # linear (a rounding-level negative a is ignored)
        return (capacity - c) / b
    return None


def longest_fitting(
    total_bytes: Callable[[int], int | None], capacity: int, step: int, limit: int
) -> Search:
    """The longest multiple of ``step`` up to ``limit`` at which ``total_bytes`` (the
    program's HBM bytes, None if it does not compile or does not fit) stays within
    ``capacity``, assuming fitting is monotone in the length."""
    known: dict[int, int | None] = {}

    def fits(n: int) -> bool:
        if n not in known:
            known[n] = total_bytes(n)
        return known[n] is not None

    def result(longest: int) -> Search:
        return Search(longest, known.get(longest), len(known))

    probes = [k * step for k in PROBES if k * step <= limit]
    if len(probes) < len(PROBES) or not all(fits(n) for n in probes):
        return result(_bisect(fits, 0, step, step, limit))
    guess = predict([(n, known[n]) for n in probes], capacity)
    low = probes[-1]
    if guess is None:
        return result(_bisect(fits, low, 2 * low, step, limit))
    guess = min(max(int(guess) // step * step, low), limit)
    if fits(guess):
        return result(_bisect(fits, guess, guess + step, step, limit))
    # Too long: gallop down from the guess until a length fits, then bisect between.
    high, gap = guess, step
    while high - gap > low and not fits(high - gap):
        high, gap = high - gap, gap * 2
    return result(_bisect(fits, max(high - gap, low), high, step, limit))


def _bisect(fits: Callable[[int], bool], low: int, high: int, step: int, limit: int) -> int:
    """Given that ``low`` fits (0 trivially), gallops ``high`` up until it does not fit (or
    passes ``limit``), then bisects to a ``step``: the longest fitting length."""
    while high <= limit and fits(high):
        low, high = high, high + 2 * (high - low)
    if high > limit:
        high = limit + step
    while high - low > step:
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
