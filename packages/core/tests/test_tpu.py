"""Which TPU generation kernels are built for."""

from __future__ import annotations

import importlib.util

import pytest

from pallas_flash import tpu


def test_off_tpu_the_default_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tpu.GENERATION_ENV_VAR, raising=False)
    assert tpu.current_generation() is tpu.DEFAULT
    assert tpu.DEFAULT.name == "v5e" and tpu.DEFAULT.vmem_bytes == 128 << 20


@pytest.mark.parametrize("name", list(tpu.GENERATIONS))
def test_the_environment_variable_chooses(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(tpu.GENERATION_ENV_VAR, name)
    assert tpu.current_generation() is tpu.GENERATIONS[name]


def test_an_unknown_name_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tpu.GENERATION_ENV_VAR, "v9z")
    with pytest.raises(ValueError, match=r"PALLAS_FLASH_TPU must be one of .*'v5e'.* got 'v9z'"):
        tpu.current_generation()


@pytest.mark.parametrize(
    ("kind", "name"),
    [("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5", "v5p"), ("TPU v6 lite", "v6e")],
)
def test_device_kinds(kind: str, name: str) -> None:
    assert tpu.for_device_kind(kind) is tpu.GENERATIONS[name]


def test_an_unknown_device_kind_gets_the_least_vmem_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="unknown TPU device kind 'TPU v99'.*PALLAS_FLASH_TPU"):
        generation = tpu.for_device_kind("TPU v99")
    assert generation is tpu.UNKNOWN
    assert generation.vmem_bytes == min(g.vmem_bytes for g in tpu.GENERATIONS.values())


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
@pytest.mark.parametrize(
    ("topology", "name"),
    [("v4:2x2x1", "v4"), ("v5e:2x2", "v5e"), ("v5p:2x2x1", "v5p"), ("v6e:2x2", "v6e")],
)
def test_the_device_kinds_of_real_topologies(topology: str, name: str) -> None:
    """The device kinds listed are those libtpu gives each generation's chips."""
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(
        platform="tpu",
        topology_name=topology,
        chip_config_name="default",
        chips_per_host_bounds=(2, 2, 1),
        num_slices=1,
    ).devices
    assert tpu.for_device_kind(devices[0].device_kind) is tpu.GENERATIONS[name]
