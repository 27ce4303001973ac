"""A TPU target's devices on a host without one: libtpu's topology, for ahead-of-time
compiles with its real compiler."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util

import jax

from pallas_flash_estimate.targets import Target


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


def cost_analysis(compiled: jax.stages.Compiled) -> dict[str, float]:
    """The compiler's cost analysis of a compiled program as one dict (older jax gave a list
    of one per program); empty where it gives none."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    return dict(cost or {})
