"""The README's report block: the comparison tables of one bench run, between two markers.

``pallas-flash readme`` rewrites the block from a ``results.json``, so every row the README
shows comes from that one run and in the report's own format; the bench's tests check that the
committed block still has that format.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

from pallas_flash_bench import calibration_report, cells, comparison, model_report

BEGIN = "<!-- pallas-flash readme: begin -->"
END = "<!-- pallas-flash readme: end -->"
MODELS_BEGIN = "<!-- pallas-flash readme models: begin -->"
MODELS_END = "<!-- pallas-flash readme models: end -->"
CALIBRATION_BEGIN = "<!-- pallas-flash calibration: begin -->"
CALIBRATION_END = "<!-- pallas-flash calibration: end -->"


def render_block(results: Mapping[str, Any]) -> str:
    """The block (markers included) for ``results``: the run it comes from, then the report's
    "Against jax's kernels" and "How sure the estimates are" sections, one heading level
    down."""
    meta = results.get("meta") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items())
    target = (meta.get("target") or {}).get("name", "unknown target")
    quick = " --quick" if meta.get("sweep") == "quick" else ""
    rows = [r for r in results.get("rows", []) if r.get("compiled")]
    sections = [
        *calibration_report.summary_section(results.get("calibration")),
        *comparison.against_references_table(rows),
        *comparison.spread_table(rows),
    ]
    lines = [
        BEGIN,
        "",
        f"From one run of `pallas-flash bench{quick} --target {target}` on "
        f"{meta.get('date') or cells.MISSING} ({versions}; a CPU host: no TPU). Every figure "
        "is an estimate; its tag says which.",
        "",
        *(f"#{line}" if line.startswith("## ") else line for line in sections),
        END,
    ]
    return "\n".join(lines) + "\n"


def render_models_block(results: Mapping[str, Any]) -> str:
    """The models block (markers included) for a ``pallas-flash bench --models`` run: its
    provenance, then the report's model sections, one heading level down."""
    meta = results.get("meta") or {}
    found = dict(meta.get("versions") or {}, model_analysis=meta.get("model_analysis"))
    versions = ", ".join(f"{k} {v}" for k, v in found.items() if k != "analysis")
    sections = model_report.model_sections(results)
    lines = [
        MODELS_BEGIN,
        "",
        f"From one run of `pallas-flash bench --models` on {meta.get('date') or cells.MISSING} "
        f"({versions}; a CPU host: no TPU). Ours are static estimates; the references were "
        "measured on TPUs.",
        "",
        *(f"#{line}" if line.startswith("## ") else line for line in sections),
        MODELS_END,
    ]
    return "\n".join(lines) + "\n"


def render_calibration_block(found: Mapping[str, Any]) -> str:
    """The calibration page's block (markers included): `calibration_report.section` of a
    ``pallas-flash bench --calibrate`` run's ``calibration.json``."""
    lines = calibration_report.section(found)
    return "\n".join([CALIBRATION_BEGIN, "", *lines, CALIBRATION_END]) + "\n"


def replace_block(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with its block (from ``begin`` to ``end``) replaced by ``block``.

    Raises:
      ValueError: ``text`` lacks either marker.
    """
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"expected the markers {begin!r} and {end!r}, in that order")
    rest = text[stop + len(end) :]
    return text[:start] + block + rest.removeprefix("\n")


def update_calibration_page(page: pathlib.Path, found: Mapping[str, Any]) -> None:
    """Rewrites the calibration page's block from a ``calibration.json``."""
    text = replace_block(page.read_text(), render_calibration_block(found), CALIBRATION_BEGIN,
                         CALIBRATION_END)  # fmt: skip
    page.write_text(text)


def update(
    readme: pathlib.Path,
    results: Mapping[str, Any] | None,
    models: Mapping[str, Any] | None = None,
) -> None:
    """Rewrites the file ``readme``'s block from ``results`` and its models block from
    ``models`` (a ``--models`` run), each when given."""
    text = readme.read_text()
    if results is not None:
        text = replace_block(text, render_block(results))
    if models is not None:
        text = replace_block(text, render_models_block(models), MODELS_BEGIN, MODELS_END)
    readme.write_text(text)
