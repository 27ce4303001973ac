"""Meshes that span processes: 2 processes on localhost with 2 CPU devices each, joined by
``jax.distributed`` as the hosts of a slice are, call the backend over one mesh of all 4
devices with NumPy inputs (`across_processes`)."""

from __future__ import annotations

import pytest

from pallas_flash_conformance.across_processes import run_job


@pytest.mark.requires("decode", "multi_device", "gqa")
def test_a_mesh_spanning_two_processes_splits_the_cache(backend) -> None:
    run_job(backend.name, "decode")


@pytest.mark.requires("context_parallel", "causal", "segment_ids")
def test_a_mesh_spanning_two_processes_splits_the_sequence(backend) -> None:
    run_job(backend.name, "context_parallel")
