"""Training: next-token loss over packed sequences, AdamW, one jitted step with donation.

Parameters and optimiser state are float32 (master weights); the forward computes in the
config's dtype (bfloat16). The step is jitted with the `TrainState` donated (by default),
so parameters and optimiser state are updated in place. Under a mesh the state keeps the
shardings of `sharding.param_shardings` and the batch is split over ``data`` x ``fsdp``
(`shard_batch`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_flash as pf
from pallas_flash_llama import distributed
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.int8_weights import is_int8
from pallas_flash_llama.loss import next_token_loss
from pallas_flash_llama.model import Params, hidden_states
from pallas_flash_llama.sharding import BATCH_AXES, batch_parts

Batch = dict[str, jax.Array]
"""``tokens [batch, seq]`` int32 and ``segment_ids [batch, seq]`` int32 (0: padding; each
packed document its own positive id), as `data.pack` makes them."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The optimiser: AdamW under linear warmup then cosine decay, after global-norm clipping.

    Attributes:
      learning_rate: the peak learning rate, reached after ``warmup_steps``.
      warmup_steps, total_steps: the schedule's length (cosine decay to ``final_lr_fraction``
        of the peak at ``total_steps``).
      weight_decay: AdamW's decoupled decay, applied to matmul weights and embeddings only.
      clip_norm: gradients are scaled down to at most this global norm.
    """

    learning_rate: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 10_000
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0

    def schedule(self) -> optax.Schedule:
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=self.learning_rate,
            warmup_steps=self.warmup_steps,
            decay_steps=max(self.total_steps, self.warmup_steps + 1),
            end_value=self.learning_rate * self.final_lr_fraction,
        )

    def optimizer(self) -> optax.GradientTransformation:
        decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
        return optax.chain(
            optax.clip_by_global_norm(self.clip_norm),
            optax.adamw(
                self.schedule(),
                b1=self.b1,
                b2=self.b2,
                eps=self.eps,
                weight_decay=self.weight_decay,
                mask=decay_mask,
            ),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Parameters, optimiser state and step count (all arrays: donated by the step)."""

    params: Params
    opt_state: optax.OptState
    step: jax.Array


def init_state(params: Params, train_config: TrainConfig) -> TrainState:
    """The state at step 0. The optimiser state takes the parameters' shardings; what is not
    laid out over their mesh (the step, the optimiser's counts) is replicated over it, so a
    state restored from a checkpoint into this one's shardings lies where the step expects.

    Raises:
      pf.UnsupportedFeatureError: ``params`` holds int8 weights (inference only).
    """
    if any(is_int8(x) for x in jax.tree.leaves(params, is_leaf=is_int8)):
        raise pf.UnsupportedFeatureError(
            "params: int8 weights (int8_weights.quantize_params) are for inference; train the "
            "floating-point parameters and quantize them after"
        )
    opt_state = _optimizer_init(train_config)(params)
    state = TrainState(params, opt_state, jnp.zeros((), jnp.int32))
    meshes = {
        x.sharding.mesh for x in jax.tree.leaves(params) if isinstance(x.sharding, NamedSharding)
    }
    if not meshes:
        return state
    replicated = NamedSharding(meshes.pop(), PartitionSpec())
    return jax.tree.map(
        lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated),
        state,
    )


@functools.cache
def _optimizer_init(train_config: TrainConfig) -> Callable[[Params], optax.OptState]:
    return jax.jit(train_config.optimizer().init)  # one compile per optimiser and shapes


def loss_fn(
    params: Params,
    batch: Batch,
    config: LlamaConfig,
    backend: str | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy over the tokens whose successor is in the same
    document (`loss.next_token_loss`); returns it and ``{"loss", "tokens"}``."""
    tokens, segments = batch["tokens"], batch["segment_ids"]
    x, _ = hidden_states(params, tokens, config, segment_ids=segments, backend=backend, mesh=mesh)
    loss, count = next_token_loss(params, x, tokens, segments, config, mesh)
    return loss, {"loss": loss, "tokens": count}


def make_train_step(
    config: LlamaConfig,
    train_config: TrainConfig,
    *,
    backend: str | None = None,
    mesh: Mesh | None = None,
    donate: bool = True,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """A jitted ``step(state, batch) -> (state, metrics)`` that donates ``state`` (updated in
    place); with ``donate`` False the state is not donated and stays usable (for measuring
    what donation saves).

    Metrics: ``loss``, ``tokens`` (counted by the loss), ``grad_norm`` (before clipping),
    ``learning_rate``.
    """
    optimizer = train_config.optimizer()
    schedule = train_config.schedule()
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        (_, metrics), grads = grad_fn(state.params, batch, config, backend, mesh)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = metrics | {
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": schedule(state.step),
        }
        return TrainState(params, opt_state, state.step + 1), metrics

    return jax.jit(step, donate_argnums=0 if donate else ())


def shard_batch(batch: Batch, mesh: Mesh | None) -> Batch:
    """``batch`` (the global batch, numpy) on the default device, or split over the mesh's
    ``data`` x ``fsdp`` axes, each process putting only its own rows on its devices (a mesh
    may span processes: `distributed`).

    Raises:
      pf.InvalidInputError: the batch size is not a multiple of data x fsdp.
    """
    if mesh is None:
        return jax.device_put(batch)
    size = batch["tokens"].shape[0]
    if size % batch_parts(mesh):
        raise pf.InvalidInputError(
            f"batch: expected a size divisible by the mesh's data x fsdp = "
            f"{batch_parts(mesh)} devices, got {size}"
        )
    return distributed.global_batch(batch, NamedSharding(mesh, PartitionSpec(BATCH_AXES, None)))
