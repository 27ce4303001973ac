"""Ahead-of-time compilation for a TPU target on a host without one (libtpu's real compiler)."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from pallas_flash_bench.subjects import ArraySpec
from pallas_flash_bench.targets import Target


class LibtpuMissingError(RuntimeError):
    """libtpu, which holds the TPU compiler, is not installed."""


def libtpu_version() -> str | None:
    """The installed libtpu's version, or None when it is not installed."""
    if importlib.util.find_spec("libtpu") is None:
        return None
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def target_devices(target: Target) -> tuple[jax.Device, ...]:
    """The first ``target.chips`` devices of the target's topology (no hardware needed)."""
    if libtpu_version() is None:
        raise LibtpuMissingError(
            "libtpu is not installed, so nothing can be compiled for a TPU: "
            "pip install 'jax[tpu]' (the pinned version is in constraints.txt)"
        )
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="tpu",
        topology_name=target.topology,
        chip_config_name="default",
        chips_per_host_bounds=target.chips_per_host_bounds,
        num_slices=1,
    )
    return tuple(topology.devices[: target.chips])


def compile_for(
    fn: Callable[..., object], specs: list[ArraySpec], target: Target
) -> jax.stages.Compiled:
    """Compiles ``fn`` for the target's first device, with arguments of the given shapes."""
    sharding = SingleDeviceSharding(target_devices(target)[0])
    structs = [
        jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding) for shape, dtype in specs
    ]
    return jax.jit(fn).trace(*structs).lower(lowering_platforms=("tpu",)).compile()
