"""The pytest plugin behind the suite: the ``--backend`` option, its fixture and markers.

Installed through the ``pytest11`` entry point, so ``pytest --pyargs pallas_flash_conformance``
works from any directory. Outside the suite's own tests it only adds the option.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import pallas_flash as pf
from pallas_flash import interpret

SUITE = "pallas_flash_conformance"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("pallas-flash conformance").addoption(
        "--backend",
        default=None,
        help="Pallas-Flash backend to check (default: $PALLAS_FLASH_BACKEND).",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "requires(*capabilities): skip unless the backend declares them all"
    )
    config.addinivalue_line(
        "markers", "pf_benchmark: a timing benchmark, run only with --benchmark-enable"
    )


def _backend_name(config: pytest.Config) -> str | None:
    return config.getoption("--backend") or os.environ.get("PALLAS_FLASH_BACKEND") or None


def _selected_backend(config: pytest.Config) -> pf.BackendInfo:
    name = _backend_name(config)
    infos = {info.name: info for info in pf.list_backends()}
    if name is None:
        raise pytest.UsageError(
            f"{SUITE}: choose the backend to check with --backend NAME or PALLAS_FLASH_BACKEND; "
            f"installed: {', '.join(infos) or 'none'}"
        )
    if name not in infos:
        pf.get_backend(name)  # raises BackendNotFoundError with the installed list
    return infos[name]


def _in_suite(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return module is not None and module.__name__.startswith(f"{SUITE}.")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    suite_items = [item for item in items if _in_suite(item)]
    if not suite_items:
        return
    backend = _selected_backend(config)
    run_benchmarks = config.getoption("benchmark_enable", False) or config.getoption(
        "benchmark_only", False
    )
    for item in suite_items:
        for marker in item.iter_markers("requires"):
            missing = set(marker.args) - backend.capabilities
            if missing:
                item.add_marker(
                    pytest.mark.skip(reason=f"{backend.name} does not declare {sorted(missing)}")
                )
        if item.get_closest_marker("pf_benchmark") and not run_benchmarks:
            item.add_marker(pytest.mark.skip(reason="benchmarks run only with --benchmark-enable"))


def pytest_report_header(config: pytest.Config) -> str | None:
    name = _backend_name(config)
    if name is None:
        return None
    info = {i.name: i for i in pf.list_backends()}.get(name)
    if info is None:
        return f"pallas-flash backend: {name} (not installed)"
    return (
        f"pallas-flash backend: {info.name} from {info.distribution}; "
        f"capabilities: {', '.join(sorted(info.capabilities))}"
    )


@pytest.fixture(autouse=True)
def _races_fail_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """With the race detector on (``PALLAS_FLASH_DETECT_RACES=1``), a suite test whose kernels
    it reports racing fails: jax 0.10's detector prints `pallas_flash.interpret.RACE_REPORT`
    and goes on (its verdict per kernel: `interpret.recorded_races`); newer jax raises it, which
    fails the test anyway."""
    if not (_in_suite(request.node) and interpret.detects_races()):
        yield
        return
    with interpret.recorded_races() as states:
        yield
    raced = sum(state.races_found for state in states)
    if raced:
        pytest.fail(
            f"the interpreter's race detector reported a data race in {raced} of the test's "
            f"{len(states)} kernel calls (its report is in the captured stdout)"
        )


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> pf.BackendInfo:
    """The backend under test, as ``pf.list_backends`` describes it."""
    return _selected_backend(request.config)
