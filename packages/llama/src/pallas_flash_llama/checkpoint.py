"""Training checkpoints: the whole `TrainState` saved with orbax, to resume a run.

Weights to generate from or to share are safetensors (`weights`). A checkpoint is what a run
needs to go on where it stopped: the float32 parameters, the optimiser state and the step,
written by an orbax ``CheckpointManager`` (in the background, keeping the last ``keep``; every
host of a multi-host job writes its own shards) and read back straight into the shardings of
a state the caller initialised the same way.
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

import pallas_flash as pf
from pallas_flash_llama.train import TrainState


def checkpoint_manager(directory: str | pathlib.Path, keep: int = 3) -> ocp.CheckpointManager:
    """An orbax manager of the checkpoints in ``directory`` (created when missing), one
    subdirectory per saved step, the newest ``keep`` kept."""
    if keep < 1:
        raise pf.InvalidInputError(f"keep: expected at least 1 checkpoint, got {keep}")
    path = pathlib.Path(directory).absolute()
    return ocp.CheckpointManager(
        path,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep),
        item_handlers=ocp.StandardCheckpointHandler(),  # so a new manager reads the metadata
    )


def save_state(manager: ocp.CheckpointManager, state: TrainState) -> None:
    """Starts saving ``state`` under its step (``state.step``); the write finishes in the
    background (``manager.wait_until_finished()`` waits for it)."""
    manager.save(int(state.step), args=ocp.args.StandardSave(state))


def restore_state(manager: ocp.CheckpointManager, like: TrainState) -> TrainState | None:
    """The newest checkpoint, placed like ``like`` (arrays or ``jax.ShapeDtypeStruct``s of the
    same structure, e.g. a freshly initialised state), or None when there is none.

    Raises:
      pf.InvalidInputError: a tensor of ``like`` is missing from the checkpoint, or has
        another shape or dtype there, or the checkpoint holds one ``like`` has not (it is of
        another model or optimiser); the error names the tensor.
    """
    step = manager.latest_step()
    if step is None:
        return None
    where = f"step {step} in {manager.directory}"
    saved = {
        leaf.name: (tuple(leaf.shape), np.dtype(leaf.dtype))
        for leaf in jax.tree.leaves(manager.item_metadata(step))
    }
    wanted = {
        _name(path): (tuple(x.shape), np.dtype(x.dtype))
        for path, x in jax.tree_util.tree_flatten_with_path(like)[0]
    }
    for name in sorted(wanted.keys() | saved.keys()):
        if name not in saved:
            raise pf.InvalidInputError(f"checkpoint: {where} has no tensor {name}")
        if name not in wanted:
            raise pf.InvalidInputError(
                f"checkpoint: {where} holds {name}, which this model and optimiser do not have"
            )
        if saved[name] != wanted[name]:
            raise pf.InvalidInputError(
                f"checkpoint: {name} in {where}: expected shape and dtype {wanted[name]}, "
                f"got {saved[name]}"
            )
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return manager.restore(step, args=ocp.args.StandardRestore(target))


def _name(path: tuple[jax.tree_util.KeyEntry, ...]) -> str:
    """A tensor's name as orbax's metadata gives it: ``opt_state.1.0.mu.embed``."""
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)
