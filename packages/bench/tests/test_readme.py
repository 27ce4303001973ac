"""The README's report block: rendered from one run, and the committed one still in the format
the bench writes."""

from __future__ import annotations

import pathlib

import pytest

from pallas_flash_bench import comparison, readme

README = pathlib.Path(__file__).parents[3] / "README.md"


def _header_line(columns: tuple[str, ...]) -> str:
    return "| " + " | ".join(columns) + " |"


def _block(text: str) -> str:
    start, end = text.index(readme.BEGIN), text.index(readme.END)
    return text[start : end + len(readme.END)]


def test_replacing_the_block_keeps_the_rest() -> None:
    text = f"# Title\n\nbefore\n\n{readme.BEGIN}\nold\n{readme.END}\n\nafter\n"
    new = f"{readme.BEGIN}\nnew\n{readme.END}\n"
    assert readme.replace_block(text, new) == f"# Title\n\nbefore\n\n{new}\nafter\n"
    with pytest.raises(ValueError, match="expected the markers"):
        readme.replace_block("no markers here", new)


def test_the_committed_readme_block_has_the_bench_format() -> None:
    """The README's tables are the bench's: same provenance line, sections and columns (a
    change of the report's format must come with a rerun of `pallas-flash readme`)."""
    block = _block(README.read_text())
    assert block.splitlines()[2].startswith("From one run of `pallas-flash bench")
    assert "### Against jax's kernels" in block
    assert "### How sure the estimates are" in block
    assert _header_line(comparison.AGAINST_REFERENCES_HEADER) in block
    assert _header_line(comparison.SPREAD_HEADER) in block
    table_lines = [line for line in block.splitlines() if line.startswith("|")]
    widths = {line.count(" | ") for line in table_lines if not line.startswith("|---")}
    assert widths <= {
        len(comparison.AGAINST_REFERENCES_HEADER) - 1,
        len(comparison.SPREAD_HEADER) - 1,
    }, "every row has its table's columns"


def test_the_models_block_is_rewritten_on_its_own(tmp_path) -> None:
    """A --models run rewrites the models block and leaves the main block alone."""
    text = (
        f"{readme.BEGIN}\nmain\n{readme.END}\n\n{readme.MODELS_BEGIN}\nold\n{readme.MODELS_END}\n"
    )
    path = tmp_path / "README.md"
    path.write_text(text)
    models = {"meta": {"date": "2026-11-25", "versions": {"jax": "0.10.2"}}, "models": []}
    readme.update(path, None, models)
    new = path.read_text()
    assert new.startswith(f"{readme.BEGIN}\nmain\n{readme.END}\n")
    assert "From one run of `pallas-flash bench --models` on 2026-11-25 (jax 0.10.2" in new
    assert "old" not in new and new.rstrip().endswith(readme.MODELS_END)


def test_the_committed_readme_has_a_models_block_from_a_models_run() -> None:
    text = README.read_text()
    start, end = text.index(readme.MODELS_BEGIN), text.index(readme.MODELS_END)
    block = text[start:end]
    assert "From one run of `pallas-flash bench --models`" in block
    assert "### Training steps against MaxText (v5e)" in block
    assert "### Serving against JetStream (v5e)" in block
