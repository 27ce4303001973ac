"""The stack matrix of docs/getting-started.md names the versions its constraints files pin.

CI runs the tests on two stacks (``STACKS`` in noxfile.py), each from a constraints file; the
docs' table says which versions those are. This keeps the table from going stale when a
constraints file moves on.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs" / "getting-started.md"
if not DOCS.is_file():  # e.g. the tests of an unpacked sdist, outside the repository
    pytest.skip("not in the repository (no docs)", allow_module_level=True)

SHOWN = ("jax", "jaxlib", "libtpu", "flax", "optax", "orbax-checkpoint")
"""What the table gives of each stack."""


def _pins(constraints: Path) -> dict[str, str]:
    pins = {}
    for line in constraints.read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.split("#")[0].strip())
        if match:
            pins[match[1].lower()] = match[2]
    return pins


def _row(stack: str) -> list[str]:
    for line in DOCS.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells and cells[0] == stack:
            return cells
    raise AssertionError(f"{DOCS}: no row for the {stack} stack")


@pytest.mark.parametrize(
    ("stack", "constraints"),
    [("pinned", "constraints.txt"), ("newest", "constraints-newest.txt")],
)
def test_the_docs_row_names_the_pinned_versions(stack: str, constraints: str) -> None:
    row = _row(stack)
    assert f"`{constraints}`" in row, row
    pins = _pins(ROOT / constraints)
    text = " ".join(row)
    missing = [f"{name}=={pins[name]}" for name in SHOWN if pins[name] not in text]
    assert not missing, f"{DOCS}, row {stack}: does not give {missing}"
