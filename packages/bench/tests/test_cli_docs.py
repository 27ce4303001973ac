"""The API page of the bench (docs/api/bench.md) against the code, so that it cannot drift.

The page is written by hand (no mkdocs plugin of the pinned set renders argparse): these tests
check that it lists every option of ``pallas-flash bench`` and ``inspect`` with its choices,
default and whether it is required, every target, figure source and figure, and every field
of a workload, and nothing that no longer exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re

import pytest

from pallas_flash_bench import cli
from pallas_flash_bench.kernels import row_figures
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_bench.views import roofline
from pallas_flash_estimate.targets import DEFAULT_TARGET, TARGETS

ROOT = pathlib.Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "api" / "bench.md"

MACHINE_DEPENDENT_DEFAULTS = {"--workers", "--cache-dir"}
"""Options whose default depends on the machine: the page describes it instead."""

if not (ROOT / "mkdocs.yml").exists():
    pytest.skip("not run from the repository: no docs to check", allow_module_level=True)


def _section(heading: str) -> str:
    """The page's text under ``## heading`` or ``### heading``, up to the next heading."""
    text = PAGE.read_text()
    match = re.search(rf"^#{{2,3}} {re.escape(heading)}\n(.*?)(?=^#{{1,3}} |\Z)", text, re.M | re.S)
    assert match, f"{PAGE.name} has no section {heading!r}"
    return match.group(1)


def _rows(section: str) -> dict[str, str]:
    """A section's table rows by the first ``code`` name of their first cell."""
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\|\s*`([^` ]+)[^|]*\|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli._parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(commands.choices)


def test_the_page_documents_every_command() -> None:
    for command in _commands():
        _section(f"`pallas-flash {command}`")


@pytest.mark.parametrize("command", sorted(_commands()))
def test_the_page_lists_every_option_of_the_command_and_no_other(command: str) -> None:
    options = {
        action.option_strings[-1]: action
        for action in _commands()[command]._actions
        if action.option_strings and not isinstance(action, argparse._HelpAction)
    }
    rows = _rows(_section(f"`pallas-flash {command}`"))
    assert sorted(rows) == sorted(options), f"docs/api/bench.md, `pallas-flash {command}`"
    for name, action in options.items():
        row = rows[name]
        for choice in action.choices or ():
            assert str(choice) in row, f"{name}: choice {choice!r} is not listed"
        if action.required:
            assert "required" in row, f"{name}: not marked required"
        elif action.default not in (None, False) and name not in MACHINE_DEPENDENT_DEFAULTS:
            assert f"`{action.default}`" in row, f"{name}: default {action.default!r} not shown"


def test_the_page_lists_every_target() -> None:
    rows = _rows(_section("Targets"))
    assert sorted(rows) == sorted(TARGETS)
    for name, target in TARGETS.items():
        assert f"`{target.topology}`" in rows[name], f"{name}: topology"
        assert f"| {target.chips} |" in rows[name], f"{name}: chips"
    assert f"`DEFAULT_TARGET` is `{DEFAULT_TARGET}`" in _section("Targets")


def test_the_page_lists_every_figure_source() -> None:
    rows = _rows(_section("Figures and their sources"))
    assert set(roofline.SOURCE_ORDER) <= set(rows)


def test_the_page_lists_every_figure_of_a_row() -> None:
    figures = row_figures.derive(
        Workload("decode", 8192, chips=4),
        TARGETS["v5e-4"],
        1.2,
        static_cycles=1000,
        has_kernels=True,
        compiler_flops=None,
        compiler_bytes=None,
        copy_bytes=0,
        collectives=[{"name": "ar", "opcode": "all-reduce", "bytes": 1024, "group": 4}],
    )
    rows = _rows(_section("Figures and their sources"))
    documented = set(rows) - {*roofline.SOURCE_ORDER, "calibrated"}
    assert documented == {*figures, "measured_seconds", "calibrated_latency_seconds"}


def test_the_page_lists_every_field_of_a_workload() -> None:
    rows = _rows(_section("Workloads"))
    assert sorted(rows) == sorted(f.name for f in dataclasses.fields(Workload))
