"""Fixtures of the ahead-of-time compile tests (`test_aot`, `test_ragged_aot`)."""

from __future__ import annotations

import jax
import pytest

from pallas_flash.interpret import INTERPRET_ENV_VAR


@pytest.fixture(scope="module")
def v5e_devices() -> list[jax.Device]:
    """The four chips of a v5e 2x2 topology (no hardware needed)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="tpu",
        topology_name="v5e:2x2",
        chip_config_name="default",
        chips_per_host_bounds=(2, 2, 1),
        num_slices=1,
    )
    return list(topology.devices)


@pytest.fixture
def mosaic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels compiled by Mosaic, not run in the interpreter (a test that compiles for TPU)."""
    monkeypatch.setenv(INTERPRET_ENV_VAR, "0")
