"""The longest-sequence search against fake compilers whose answer is known by brute force."""

from collections.abc import Callable

import pytest

from pallas_flash_bench.runs.fit import longest_fitting, predict

GIB = 1 << 30
CAPACITY = 16 * GIB
STEP = 256
LIMIT = 1 << 21


def _compiler(bytes_at: Callable[[int], int]) -> Callable[[int], int | None]:
    """A fake compile: the total at n, or None past the capacity."""
    return lambda n: bytes_at(n) if bytes_at(n) <= CAPACITY else None


def _brute_force(bytes_at: Callable[[int], int]) -> int:
    n = 0
    while n + STEP <= LIMIT and bytes_at(n + STEP) <= CAPACITY:
        n += STEP
    return n


SCORES = lambda n: 16 * 4 * n * n + 4 * 16 * 128 * 2 * n + (1 << 20)  # noqa: E731 - f32 N x N
STREAMED = lambda n: 4 * 16 * 128 * 2 * n + (1 << 20)  # noqa: E731 - q, k, v, o only
PADDED = lambda n: STREAMED(-(-n // 4096) * 4096)  # noqa: E731 - rounded up to 4096-row blocks
SPIKE = lambda n: SCORES(n) + (6 * GIB if n > 3 * 4096 else 0)  # noqa: E731 - a buffer appears


@pytest.mark.parametrize(
    ("bytes_at", "most_compiles"),
    [(SCORES, 5), (STREAMED, 5), (PADDED, 25), (SPIKE, 15)],
    ids=["quadratic", "linear", "padded", "jump"],
)
def test_finds_what_a_step_by_step_search_finds(bytes_at, most_compiles: int) -> None:
    found = longest_fitting(_compiler(bytes_at), CAPACITY, STEP, LIMIT)
    assert found.longest == _brute_force(bytes_at)
    assert found.total == bytes_at(found.longest)
    assert found.compiles <= most_compiles


def test_an_exact_polynomial_takes_five_compiles() -> None:
    """Three probes, the prediction, and its next step."""
    assert longest_fitting(_compiler(SCORES), CAPACITY, STEP, LIMIT).compiles == 5


def test_fitting_everywhere_stops_at_the_limit() -> None:
    found = longest_fitting(lambda n: n, CAPACITY, STEP, LIMIT)
    assert found.longest == LIMIT


@pytest.mark.parametrize(("gib_per_token", "longest"), [(1, 0), (1 / 64, 1024)])
def test_probes_that_do_not_fit_fall_back_to_bisection(gib_per_token: float, longest: int) -> None:
    bytes_at = lambda n: int(GIB * gib_per_token * n)  # noqa: E731
    assert longest_fitting(_compiler(bytes_at), CAPACITY, STEP, LIMIT).longest == longest


def test_predict_solves_the_quadratic() -> None:
    points = [(n, SCORES(n)) for n in (1024, 2048, 4096)]
    crossing = predict(points, CAPACITY)
    assert SCORES(int(crossing)) <= CAPACITY < SCORES(int(crossing) + 1)
    assert predict([(1, 5), (2, 5), (3, 5)], CAPACITY) is None
