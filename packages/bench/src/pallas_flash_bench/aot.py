"""How the bench compiles a call for a TPU target on a host without one: over a mesh of the
target's chips (`pallas_flash_estimate.aot.devices`), its arguments split as their specs say."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pallas_flash_estimate.aot.devices import target_devices
from pallas_flash_estimate.aot.program_ref import ArraySpec
from pallas_flash_estimate.targets import Target

MESH_AXIS = "chips"


def mesh_of(devices: Sequence[jax.Device], chips: int) -> Mesh | None:
    """A 1-D mesh (axis `MESH_AXIS`) of the first ``chips`` devices; None for one chip."""
    if chips == 1:
        return None
    if chips > len(devices):
        raise ValueError(f"chips: expected at most the {len(devices)} devices, got {chips}")
    return Mesh(np.array(devices[:chips]), (MESH_AXIS,))


def call_mesh(target: Target, chips: int) -> Mesh | None:
    """`mesh_of` the target's devices: where a call on ``chips`` chips is compiled."""
    return None if chips == 1 else mesh_of(target_devices(target), chips)


def sharding(spec: ArraySpec, mesh: Mesh) -> NamedSharding:
    """How an argument lies on the mesh: split along its ``split_axis``, else replicated."""
    axes = [None] * len(spec.shape)
    if spec.split_axis is not None:
        axes[spec.split_axis] = MESH_AXIS
    return NamedSharding(mesh, PartitionSpec(*axes))


def whole_vmem_options(target: Target) -> dict[str, str]:
    """XLA options that give a program's kernels the target core's whole VMEM as their
    scoped-VMEM limit (the most the pallas backend's kernels request), for kernels that set
    none themselves: the default limit, 16 MiB on v5e, rejects e.g. splash's 2048/2048."""
    return {"xla_tpu_scoped_vmem_limit_kib": str(target.vmem_bytes // 1024)}


def compile_for(
    fn: Callable[..., object],
    specs: list[ArraySpec],
    target: Target,
    mesh: Mesh | None = None,
    compiler_options: Mapping[str, str] | None = None,
    donate: tuple[int, ...] = (),
) -> jax.stages.Compiled:
    """Compiles ``fn`` with arguments of the given shapes for the target's first device or,
    given a mesh of its devices (`call_mesh`), as one SPMD program over the mesh with each
    argument split along its ``split_axis`` (replicated without one).

    ``compiler_options`` are XLA options of this program alone (e.g.
    ``xla_tpu_scoped_vmem_limit_kib``). ``donate``: the arguments the program may overwrite
    (`Subject.donate`). The target's first device is jax's default device
    while ``fn`` is traced, for code that asks it which chip it runs on.
    """
    if mesh is None:
        device = SingleDeviceSharding(target_devices(target)[0])
        shardings = [device] * len(specs)
    else:
        shardings = [sharding(spec, mesh) for spec in specs]
    structs = [
        jax.ShapeDtypeStruct(spec.shape, jnp.dtype(spec.dtype), sharding=placed)
        for spec, placed in zip(specs, shardings, strict=True)
    ]
    with jax.default_device(target_devices(target)[0]):
        traced = jax.jit(fn, donate_argnums=donate).trace(*structs)
        lowered = traced.lower(lowering_platforms=("tpu",))
    return lowered.compile(compiler_options=dict(compiler_options or {}))
