"""Subjects: a backend's cache-key version follows its sources."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from pallas_flash_bench import subjects


def test_the_sources_digest_changes_with_any_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "fingerprinted_pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("A = 1\n")
    (package / "sub" / "kernel.py").write_text("B = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    before = subjects._sources_digest("fingerprinted_pkg")
    assert before == subjects._sources_digest("fingerprinted_pkg")
    (package / "sub" / "kernel.py").write_text("B = 3\n")
    assert subjects._sources_digest("fingerprinted_pkg") != before
    sys.modules.pop("fingerprinted_pkg", None)


def test_installed_backends_carry_their_sources_digest() -> None:
    versions = {s.name: s.version for s in subjects.backend_subjects()}
    version, digests = versions["xla"].split("+")
    assert version and len(digests.split("-")) == 2  # core's and the backend's
