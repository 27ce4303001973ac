"""Subjects: a backend's cache-key version follows its sources."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import pallas_flash as pf
from pallas_flash_bench.kernels import references, subjects
from pallas_flash_bench.kernels.workloads import Workload


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


def test_over_a_mesh_only_multi_device_backends_decode() -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("chips",))  # any mesh: builds only check for one
    four = Workload("decode", 8192, chips=4)
    every = references.all_subjects("default", None, True)
    built = {sid for sid, s in every.items() if s.build(four, mesh) is not None}
    multi_device = {i.name for i in pf.list_backends() if "multi_device" in i.capabilities}
    assert built == multi_device
    assert every["xla"].build(Workload("decode", 8192), None) is not None


def test_the_paged_reference_runs_its_blocks_as_grid_steps() -> None:
    (paged,) = [s for s in references.reference_subjects("quick") if s.name == "jax-paged"]
    assert paged.config == "grid of 16-page blocks"
    assert paged.build(Workload("decode", 8192), None) is not None
    assert paged.build(Workload("decode", 8192, batch=2), None) is None
