"""The serving engine's device step: one jitted call runs a continuous-batching step (a
`scheduler.StepPlan`) through the model against the paged cache and samples each slot's next
token.

A step's new tokens are one flat batch padded to the token budget (`StepBatch`), laid out as
`pallas_flash.ragged_batch` says: slot ``s`` (a row of the page table) owns tokens
``query_starts[s]`` to ``query_starts[s + 1] - 1`` at its positions up to ``kv_lengths[s] -
1``; an idle slot has none. The host's scheduler owns the pages (`page_pool.PagePool`, which
shares a prefix's pages between sequences): the step takes its page table whole, each
sequence with tokens in it holding its pages in its row (-1 elsewhere), and the device
allocator of the cache only carries it. The model then runs the batch as one row ``[1,
token_budget]``: each layer's `attention.ragged_cached_attention` writes the tokens' K/V
into its pool and attends through ``pf.ragged_attention``. Each sampling slot's logits come
from its last token's hidden state; it samples with its own parameters and a key folded from
its request's seed and the index of the token in the request, so a request's tokens do not
depend on what else is batched. The step is jitted once per cache and config
(`generation.jit_step`), the cache donated: no step copies it; it compiles once per token
bucket (`token_buckets`), the smallest that holds a step's tokens padding it, so that a step
of decodes alone does not compute a whole budget's padding.

Over a mesh the model is tensor-parallel (`sharding.RULES`, the mesh's batch axes of size 1)
and the cache's kv heads are split over ``tensor`` (`kv_cache.pool_sharding`, ``"heads"``):
each device attends with its own heads over every page, as vLLM's tensor parallelism does;
the page table is the same on every device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import pallas_flash as pf
from pallas_flash.ragged_batch import token_places
from pallas_flash_llama import sharding
from pallas_flash_llama.attention import ragged_cached_attention
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.generation import jit_step
from pallas_flash_llama.kv_cache import KVCache
from pallas_flash_llama.layers import decoder_layer
from pallas_flash_llama.logit_processing import LogitEdits, apply_edits
from pallas_flash_llama.logprobs import RowLogprobs, row_logprobs
from pallas_flash_llama.model import Params, embed, unembed
from pallas_flash_llama.sampling import sample_rows

SMALLEST_BUCKET = 16
"""The fewest tokens a step is padded to."""


def token_buckets(token_budget: int) -> tuple[int, ...]:
    """The step sizes the engine compiles for ``token_budget``: the powers of two from
    `SMALLEST_BUCKET` below it, then the budget itself (``[16, 32, 64, 128, 256, 512]`` for
    512, ``[16, 32, 64, 128, 200]`` for 200)."""
    buckets, size = [], SMALLEST_BUCKET
    while size < token_budget:
        buckets.append(size)
        size *= 2
    return (*buckets, token_budget)


def bucket_for(tokens: int, buckets: tuple[int, ...]) -> int:
    """The smallest of ``buckets`` (ascending) that holds ``tokens``."""
    return next(b for b in buckets if b >= tokens)


class StepBatch(NamedTuple):
    """One step's inputs (module doc); ``slots`` is the cache's batch.

    Attributes:
      tokens: ``[bucket]`` int32 new tokens, slot by slot, then padding (`token_buckets`).
      query_starts: ``[slots + 1]`` int32.
      kv_lengths: ``[slots]`` int32 positions of each slot once its tokens are cached (0 for
        an idle slot).
      page_table: ``[slots, pages_per_sequence]`` int32, each slot's pages (-1: none), the
        scheduler's (`scheduler.Work.pages`).
      sample_rows: ``[slots]`` int32, the token whose logits the slot samples from (its
        last), or -1: the slot samples nothing.
      temperature: ``[slots]`` float32, 0 for greedy.
      top_k: ``[slots]`` int32 (the vocabulary: no limit).
      top_p: ``[slots]`` float32 (1: no limit).
      seeds: ``[slots]`` uint32, the request's seed.
      counts: ``[slots]`` int32, the index in its request of the token the slot samples.
    """

    tokens: jax.Array
    query_starts: jax.Array
    kv_lengths: jax.Array
    page_table: jax.Array
    sample_rows: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    counts: jax.Array

    @classmethod
    def empty(cls, slots: int, token_budget: int, pages_per_sequence: int) -> StepBatch:
        """A batch of numpy arrays with no token and no page, to fill on the host."""
        zeros = functools.partial(np.zeros, slots)
        return cls(np.zeros(token_budget, np.int32), np.zeros(slots + 1, np.int32),
                   zeros(np.int32), np.full((slots, pages_per_sequence), -1, np.int32),
                   np.full(slots, -1, np.int32),
                   zeros(np.float32), zeros(np.int32), np.ones(slots, np.float32),
                   zeros(np.uint32), zeros(np.int32))  # fmt: skip


def run_step(
    params: Params,
    cache: KVCache,
    batch: StepBatch,
    config: LlamaConfig,
    backend: str | None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, KVCache]:
    """Runs one step (module doc).

    Args:
      params: `generation.inference_params` (with ``mesh``: sharded by `sharding.RULES`).
      cache: a paged cache (`kv_cache.init_cache`, donated): on one device, or with ``mesh``
        split over its kv heads.
      batch: the step's inputs.
      mesh: a ``(1, 1, tensor)`` mesh (`sharding.make_mesh`), or None for one device.

    Returns:
      ``[slots]`` int32, each sampling slot's next token (-1 for the others), and the cache
      with the tokens' K/V written, their slots' lengths ``kv_lengths``.
    """
    return step_program(cache, config, backend, mesh)(params, cache, batch)


def step_program(
    cache: KVCache,
    config: LlamaConfig,
    backend: str | None,
    mesh: Mesh | None = None,
    extras: bool = False,
) -> jax.stages.Wrapped:
    """The jitted step of `run_step` for ``cache`` (its arrays may be abstract, to compile it
    ahead of time). With ``extras``, the program of its own that also scores tokens or edits
    logits (`run_step_with`).

    Raises:
      pf.InvalidInputError: a cache not paged, or with ``mesh`` not split over its kv heads.
    """
    if not cache.paged or (mesh is not None and cache.split != "heads"):
        raise pf.InvalidInputError(
            "cache: the engine's step takes a paged cache, split over its kv heads on a mesh "
            f"(kv_cache.init_cache(..., split='heads')); got paged={cache.paged}, "
            f"split={cache.split!r}"
        )
    return jit_step(_step_with if extras else _step, cache, config, backend, mesh)


class StepExtras(NamedTuple):
    """What a step does beyond `run_step` (`run_step_with`), each None where it is not done.

    Attributes:
      next_tokens: ``[bucket]`` int32, the token after each of the step's tokens to score
        (-1: none; a prompt's next token, for ``prompt_logprobs``); None: the step scores
        only the sampled tokens.
      edits: the slots' logit edits before sampling (`logit_processing`).
      sampled_scored: ``[slots]`` bool, the slots whose sampled token the step scores (the
        others' rows score nothing); None: the step scores no sampled token.
    """

    next_tokens: jax.Array | None = None
    edits: LogitEdits | None = None
    sampled_scored: jax.Array | None = None


def run_step_with(
    params: Params,
    cache: KVCache,
    batch: StepBatch,
    extras: StepExtras,
    config: LlamaConfig,
    backend: str | None,
    mesh: Mesh | None = None,
) -> tuple[tuple[jax.Array, RowLogprobs | None, RowLogprobs | None], KVCache]:
    """`run_step` in a program of its own (one per structure of ``extras``), whose sampled
    tokens are drawn from logits edited by ``extras.edits``; it also returns, with
    ``extras.sampled_scored``, the logprobs (`logprobs.row_logprobs`) of those slots'
    sampled tokens (``[slots]`` rows) and, with ``extras.next_tokens``, of those tokens, all
    from the raw logits of their rows (None: not asked)."""
    program = step_program(cache, config, backend, mesh, extras=True)
    return program(params, cache, batch, extras)


def _step(params, cache, batch, config, backend, mesh):
    x, cache = _forward(params, cache, batch, config, backend, mesh)
    logits = unembed(params, x[0, jnp.maximum(batch.sample_rows, 0)], config)
    return _sample(logits, batch), cache


def _step_with(params, cache, batch, extras, config, backend, mesh):
    x, cache = _forward(params, cache, batch, config, backend, mesh)
    rows = jnp.maximum(batch.sample_rows, 0)
    if extras.next_tokens is None:
        logits, scored = unembed(params, x[0, rows], config), None
    else:
        every = unembed(params, x[0], config)  # [bucket, vocab]
        logits, scored = every[rows], row_logprobs(every, extras.next_tokens)
    edited = logits if extras.edits is None else apply_edits(logits, extras.edits,
                                                              batch.temperature)  # fmt: skip
    sampled = _sample(edited, batch)
    if extras.sampled_scored is not None:
        chosen = row_logprobs(logits, jnp.where(extras.sampled_scored, sampled, -1))
    else:
        chosen = None
    return (sampled, chosen, scored), cache


def _sample(logits: jax.Array, batch: StepBatch) -> jax.Array:
    """Each sampling slot's next token from its ``logits [slots, vocab]`` (-1 for the
    others), drawn with a key folded from its request's seed and the token's index."""
    keys = jax.vmap(lambda seed, count: jax.random.fold_in(jax.random.key(seed), count))(
        batch.seeds, batch.counts
    )
    tokens = sample_rows(logits, keys, batch.temperature, batch.top_k, batch.top_p)
    return jnp.where(batch.sample_rows >= 0, tokens, -1)


def _forward(params, cache, batch, config, backend, mesh):
    """The step's tokens through the model: hidden states ``[1, bucket, embed]`` and the
    cache with their K/V written."""
    pages = dataclasses.replace(cache.pages, page_table=batch.page_table)
    cache = dataclasses.replace(cache, pages=pages)
    places = token_places(batch.query_starts, batch.kv_lengths, batch.tokens.shape[0])
    x = sharding.constrain(embed(params, batch.tokens[None], config),
                           ("batch", "seq", "act_embed"), mesh)  # fmt: skip
    layers = []
    for i, layer in enumerate(params["layers"]):
        attend = functools.partial(ragged_cached_attention, cache=cache.layer(i),
                                   query_starts=batch.query_starts,
                                   kv_lengths=batch.kv_lengths, backend=backend,
                                   mesh=mesh)  # fmt: skip
        x, layer_cache = decoder_layer(x, layer, places.position[None], attend, config, mesh)
        layers.append(layer_cache)
    return x, cache.with_layers(layers, batch.kv_lengths)
