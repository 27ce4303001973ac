"""The ``--every-nth-case N`` option: each parametrized test runs one case in ``N``.

For a stack that checks compatibility rather than every case (CI's newest stack): every test
function still runs, on the first of its cases and every ``N``-th after it, counted in
collection order among the cases that are not skipped (a backend's undeclared features are
skipped, so they are not counted). The choice depends only on the collected tests, never on
time or the machine: the same tests run on every run of a commit.

Installed through the ``pytest11`` entry point with the conformance suite's own plugin, so
it is there in every test session that installs the suite.
"""

from __future__ import annotations

import collections

import pytest

OPTION = "--every-nth-case"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("pallas-flash conformance").addoption(
        OPTION,
        type=int,
        default=1,
        metavar="N",
        help="run the first and every N-th case of each parametrized test (default 1: all)",
    )


def _function(item: pytest.Item) -> tuple[str, str]:
    """The test function an item is a case of: its file and its name without parameters."""
    return item.nodeid.split("::")[0], getattr(item, "originalname", item.name)


def _skipped(item: pytest.Item) -> bool:
    """Marked to skip: by ``skip``, or by a ``skipif`` whose condition is a true bool (a
    condition given as a string is evaluated only when the test runs: counted as running)."""
    if item.get_closest_marker("skip") is not None:
        return True
    return any(
        (bool(mark.args) and mark.args[0] is True) or mark.kwargs.get("condition") is True
        for mark in item.iter_markers("skipif")
    )


@pytest.hookimpl(trylast=True)  # after the suite's plugin has marked undeclared features skipped
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    every = config.getoption(OPTION)
    if every < 1:
        raise pytest.UsageError(f"{OPTION} must be at least 1, got {every}")
    if every == 1:
        return
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    kept, dropped = [], []
    for item in items:
        if _skipped(item):
            kept.append(item)
            continue
        function = _function(item)
        (kept if seen[function] % every == 0 else dropped).append(item)
        seen[function] += 1
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
