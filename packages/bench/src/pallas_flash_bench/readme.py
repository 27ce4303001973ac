"""The README's report block: the comparison tables of one bench run, between two markers.

``pallas-flash readme`` rewrites the block from a ``results.json``, so every row the README
shows comes from that one run and in the report's own format; the bench's tests check that the
committed block still has that format.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

from pallas_flash_bench import cells, comparison

BEGIN = "<!-- pallas-flash readme: begin -->"
END = "<!-- pallas-flash readme: end -->"


def render_block(results: Mapping[str, Any]) -> str:
    """The block (markers included) for ``results``: the run it comes from, then the report's
    "Against jax's kernels" and "How sure the estimates are" sections, one heading level
    down."""
    meta = results.get("meta") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items())
    target = (meta.get("target") or {}).get("name", "unknown target")
    quick = " --quick" if meta.get("sweep") == "quick" else ""
    rows = [r for r in results.get("rows", []) if r.get("compiled")]
    sections = comparison.against_references_table(rows) + comparison.spread_table(rows)
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


def replace_block(text: str, block: str) -> str:
    """``text`` with its block (from `BEGIN` to `END`) replaced by ``block``.

    Raises:
      ValueError: ``text`` lacks either marker.
    """
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"expected the markers {BEGIN!r} and {END!r}, in that order")
    rest = text[end + len(END) :]
    return text[:start] + block + rest.removeprefix("\n")


def update(readme: pathlib.Path, results: Mapping[str, Any]) -> None:
    """Rewrites the block of the file ``readme`` from ``results``."""
    readme.write_text(replace_block(readme.read_text(), render_block(results)))
