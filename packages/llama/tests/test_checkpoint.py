"""Training checkpoints: a state saves and restores whole into a new manager, and restoring
checks every tensor against the model and optimiser (that a resumed run equals one that never
stopped is test_cli's resume test)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_llama import checkpoint, model
from pallas_flash_llama.config import get_config
from pallas_flash_llama.train import TrainConfig, init_state

CONFIG = get_config("tiny")
TRAIN = TrainConfig()


def _state(config=CONFIG, seed: int = 0):
    return init_state(model.init_params(config, jax.random.key(seed)), TRAIN)


def test_a_state_restores_whole_and_mismatches_are_named_errors(tmp_path) -> None:
    manager = checkpoint.checkpoint_manager(tmp_path)
    assert checkpoint.restore_state(manager, _state()) is None
    saved = _state(seed=0)
    checkpoint.save_state(manager, saved)
    manager.wait_until_finished()
    manager.close()

    manager = checkpoint.checkpoint_manager(tmp_path)  # as a new process would
    restored = checkpoint.restore_state(manager, _state(seed=1))
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    for got, expected in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(got, expected)

    with pytest.raises(
        pf.InvalidInputError,
        match=r"checkpoint: opt_state.1.0.mu.layers.attn_norm in step 0 .*"
        r"expected shape and dtype \(\(1, 64\), dtype\('float32'\)\), got \(\(2, 64\)",
    ):
        checkpoint.restore_state(manager, _state(CONFIG.replace(layers=1)))
    no_optimiser = dataclasses.replace(_state(), opt_state=())
    with pytest.raises(pf.InvalidInputError, match=r"step 0 in .* holds opt_state.1.0.count, "):
        checkpoint.restore_state(manager, no_optimiser)
    manager.close()
    with pytest.raises(pf.InvalidInputError, match="keep: expected at least 1"):
        checkpoint.checkpoint_manager(tmp_path, keep=0)
