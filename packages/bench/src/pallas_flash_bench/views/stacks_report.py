"""One sweep on two stacks side by side: the pinned stack (constraints.txt, behind every
published figure) and the newest one the registry serves (constraints-newest.txt), each run's
``results.json`` as `pallas-flash bench` wrote it.

Two tables: each backend's verdict against jax's fastest kernel on either stack
(`comparison.headlines`), and every program compiled on both with its static latency on each:
where a newer compiler, or a newer reference, moved a figure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pallas_flash_bench.kernels import stack_comparison
from pallas_flash_bench.views.cells import (
    MISSING,
    figure,
    label,
    markdown_table,
    ms,
    sort_key,
    subject,
)
from pallas_flash_bench.views.comparison import ESTIMATE_TITLES, headlines

Rows = Sequence[Mapping[str, Any]]
"""One run's compiled rows (``results.json``'s ``rows``)."""

VERDICTS_HEADER = ("Workload", "Backend", "Pinned: fastest jax kernel", "Pinned: speed-up",
                   "Pinned: verdict", "Newest: fastest jax kernel", "Newest: speed-up",
                   "Newest: verdict", "Moved")  # fmt: skip
"""Columns of `verdicts_table`."""

PROGRAMS_HEADER = ("Workload", "Program", "Pinned latency", "Newest latency", "Newest / pinned")
"""Columns of `programs_table`."""


def _first_word(verdict: str) -> str:
    """``ahead`` of ``ahead under 4 of 6, level under 2``."""
    return verdict.split(" ", 1)[0]


def verdicts_table(pinned: Rows, newest: Rows) -> list[str]:
    """Each backend's headline (`comparison.headlines`) on both stacks, by workload; *Moved*
    says where the verdict's leading word differs (``ahead -> level``), and a row one stack
    lacks reads as missing there."""
    before = {entry.key: entry for entry in headlines(pinned)}
    after = {entry.key: entry for entry in headlines(newest)}
    table = []
    for key in [*before, *(k for k in after if k not in before)]:
        old, new = before.get(key), after.get(key)
        cells = []
        for entry in (old, new):
            cells += [entry.fastest, entry.speedup, entry.verdict] if entry else [MISSING] * 3
        moved = (MISSING if old is None or new is None
                 else "no" if _first_word(old.verdict) == _first_word(new.verdict)
                 else f"{_first_word(old.verdict)} -> {_first_word(new.verdict)}")  # fmt: skip
        table.append([*key, *cells, moved])
    return [*markdown_table(VERDICTS_HEADER, table), ""] if table else []


def _program(row: Mapping[str, Any]) -> list[str]:
    return [label(row), subject(row)]


def programs_table(pinned: Rows, newest: Rows) -> list[str]:
    """Every program (a backend or a reference in one configuration, on one workload) with a
    static latency on both stacks, and the newest over the pinned
    (`stack_comparison.latency_ratios`): above 1, slower on the newest stack."""
    found = sorted(stack_comparison.latency_ratios(pinned, newest),
                   key=lambda entry: sort_key(entry["newest"]))  # fmt: skip
    table = [[*_program(e["newest"]), ms(figure(e["pinned"], "latency_seconds")[0]),
              ms(figure(e["newest"], "latency_seconds")[0]), f"{e['ratio']:.3f}"]
             for e in found]  # fmt: skip
    return [*markdown_table(PROGRAMS_HEADER, table), ""] if table else []


def only_on_one(pinned: Rows, newest: Rows) -> list[str]:
    """The programs compiled on one stack and not the other (`stack_comparison.only_on_one`),
    as a list; empty when both compiled the same."""
    lines = [
        f"- only on the {stack} stack: {', '.join(_program(row))}"
        for stack, rows in stack_comparison.only_on_one(pinned, newest).items()
        for row in sorted(rows, key=lambda r: (label(r), subject(r)))
    ]
    return [*lines, ""] if lines else []


def unknown_on_one(pinned: Rows, newest: Rows) -> list[str]:
    """The programs with a figure under an estimate on one stack and none on the other
    (`stack_comparison.unknown_on_one`): where the estimator could not read one compiler's
    output. Their verdicts read unknown under it there, and without the DMA estimate's block
    copies the calibrated figure charges no first block (`runner.calibrated_latency`): it is
    then too short."""
    found = sorted(stack_comparison.unknown_on_one(pinned, newest),
                   key=lambda entry: sort_key(entry["row"]))  # fmt: skip
    lines = [f"- unknown on the {e['stack']} stack only: {', '.join(_program(e['row']))} under "
             f"{', '.join(ESTIMATE_TITLES[name] for name in sorted(e['estimates']))}"
             for e in found]  # fmt: skip
    return [*lines, ""] if lines else []


def stacks_section(pinned: Mapping[str, Any], newest: Mapping[str, Any]) -> list[str]:
    """The page's body: the verdicts on both stacks, then the programs' figures on both."""
    rows = [[r for r in run.get("rows", []) if r.get("compiled")] for run in (pinned, newest)]
    return [
        "## Verdicts on both stacks", "",
        "Each backend against the jax kernel fastest on its workload on each stack, "
        "calibrated (the calibration was fitted on the pinned stack's compiles; the newest "
        "stack's programs go through the same fit). *Moved*: where the verdict's leading "
        "word differs between the stacks.", "",
        *verdicts_table(*rows),
        "## Each program on both stacks", "",
        "The static latency of every program compiled on both stacks (no calibration): a ratio "
        "above 1 is a program the newest stack's compiler (or the reference's newer release) "
        "made slower.", "",
        *programs_table(*rows),
        *only_on_one(*rows),
        *unknown_on_one(*rows),
    ]  # fmt: skip
