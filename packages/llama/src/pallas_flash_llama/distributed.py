"""Jobs over several processes: jax's multi-controller runtime, one process per host.

Every process runs the same program on its own devices; `initialize` connects them through
jax's coordination service (``jax.distributed``), after which ``jax.devices()`` lists every
process's devices and a mesh may span them. Each process feeds only its share of a global
batch (`global_batch`), reads back values through `pallas_flash.mesh_placement.to_host`
(which gathers what other processes hold), and only the main process (`is_main`) prints or
writes files that are not checkpoints (orbax writes those from every process).

On CPU the collectives between processes run over gloo, so several processes on one machine
stand in for the hosts of a slice; on a Cloud TPU slice jax finds the hosts itself.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
from jax.sharding import NamedSharding

import pallas_flash as pf

HEARTBEAT_TIMEOUT_S = 60
"""How long the coordination service waits for a silent process before it fails the job."""


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
) -> bool:
    """Joins this process to a multi-process job; returns whether it did.

    Args:
      coordinator: ``host:port`` of process 0's coordination service; with ``num_processes``
        and ``process_id`` (this process's rank, from 0) it describes the job explicitly
        (several processes on one machine, or hosts without a cluster manager).
      auto: let jax detect the job from the environment (Cloud TPU slices, SLURM, Open MPI);
        the default when only ``auto`` is set.
      heartbeat_timeout_s: a process silent for this long fails every other one with an
        error (instead of a hang).

    Call it before anything touches a device. Nothing happens when neither ``coordinator``
    nor ``auto`` is given.

    Raises:
      pf.InvalidInputError: ``coordinator`` without ``num_processes`` and ``process_id``, or
        a ``process_id`` outside ``[0, num_processes)``.
    """
    if coordinator is None and not auto:
        return False
    if coordinator is not None:
        if num_processes is None or process_id is None:
            raise pf.InvalidInputError(
                "coordinator: expected --num-processes and --process-id with it"
            )
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise pf.InvalidInputError(
                f"process_id: expected 0 <= process_id < num_processes={num_processes}, "
                f"got {process_id}"
            )
    # Gloo carries collectives between CPU processes; TPU and GPU clients ignore the option.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator,
        num_processes,
        process_id,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
    return True


def is_main() -> bool:
    """Whether this is the process that logs and writes (process 0)."""
    return jax.process_index() == 0


def local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The rows of a ``[rows, ...]`` array of ``shape`` laid out by ``sharding`` that this process's
    devices hold (one contiguous range, as meshes over processes lay them out).

    Raises:
      pf.InvalidInputError: this process's devices hold rows that are not contiguous.
    """
    indices = sharding.addressable_devices_indices_map(shape).values()
    held = sorted({index[0].indices(shape[0])[:2] for index in indices})
    if any(stop != start for (_, stop), (start, _) in itertools.pairwise(held)):
        raise pf.InvalidInputError(
            f"mesh: process {jax.process_index()} holds rows {held} of the batch, not one "
            "range; order the mesh's devices by process"
        )
    start, stop = held[0][0], held[-1][1]
    return slice(start, stop)


def global_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Global arrays laid out by ``sharding`` from a batch every process knows whole
    (``[rows, ...]`` numpy arrays): each process puts only its own rows on its devices."""
    out = {}
    for name, array in batch.items():
        rows = local_rows(sharding, array.shape)
        out[name] = jax.make_array_from_process_local_data(sharding, array[rows], array.shape)
    return out
