"""Choosing the next token from logits: greedy, temperature, top-k and top-p.

Top-k and top-p follow vLLM's definitions (`vllm/v1/sample/ops/topk_topp_sampler.py`,
``apply_top_k_top_p``): top-k keeps the ``top_k`` most likely tokens; top-p then keeps, of
those, each token whose more likely tokens hold less than ``top_p`` of their renormalised
mass (so the most likely always stays).

The engine's sampler (`sample_rows`) keeps the full sort of the vocabulary off its path:
- a step whose slots are all greedy takes the argmax alone (a ``lax.cond``);
- a filtered row samples among its `PREFILTER` most likely tokens (``lax.top_k``) whenever
  its filters keep only those: ``top_k <= PREFILTER``, or top-p alone with those candidates
  holding at least ``top_p`` of the row's mass (then top-p over the candidates at ``top_p /
  mass`` keeps exactly the tokens it keeps over the vocabulary);
- a row with no filter samples from its whole distribution, with no sort;
- only a row whose filters reach past the candidates (a larger ``top_k``, or a flat
  distribution under top-p) makes the step sort the vocabulary (`filter_rows`), under a
  ``lax.cond`` taken only then.
Each row's distribution is the one `filter_rows` defines, whichever path draws it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import pallas_flash as pf

PREFILTER = 256
"""The most likely tokens a filtered row of `sample_rows` samples among (module doc)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick each next token (hashable: a static jit argument).

    Attributes:
      temperature: 0 picks the most likely token (greedy); otherwise logits are divided by it
        before sampling.
      top_k: sample only among the ``top_k`` most likely tokens.
      top_p: sample only among the most likely tokens whose probabilities sum to ``top_p``
        (nucleus sampling; the most likely token always stays).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise pf.InvalidInputError(f"temperature: expected >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise pf.InvalidInputError(f"top_k: expected a positive int, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise pf.InvalidInputError(f"top_p: expected 0 < top_p <= 1, got {self.top_p}")


def filter_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """``logits [batch, vocab]`` float32 divided by the temperature, with the tokens top-k and
    top-p exclude set to -inf."""
    return filter_rows(logits, sampling.temperature, sampling.top_k, sampling.top_p)


def filter_rows(
    logits: jax.Array,
    temperature: jax.Array | float,
    top_k: jax.Array | int | None = None,
    top_p: jax.Array | float | None = None,
) -> jax.Array:
    """`filter_logits` with a parameter per row: ``logits [batch, vocab]`` float32 divided by
    ``temperature`` (``[batch]`` or a scalar, > 0), the tokens outside each row's ``top_k``
    (``[batch]`` int32 or a scalar; the vocabulary or more keeps all) and ``top_p`` (``[batch]``
    float32 or a scalar; 1 keeps all) set to -inf. None skips that filter for every row."""
    logits = logits.astype(jnp.float32) / _per_row(temperature, jnp.float32)
    vocab = logits.shape[-1]
    if top_k is None and top_p is None:
        return logits
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    if top_k is not None:
        index = jnp.clip(_per_row(top_k, jnp.int32) - 1, 0, vocab - 1)
        kth = jnp.take_along_axis(ordered, index, axis=-1)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
        ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    if top_p is not None:
        top_p = _per_row(top_p, jnp.float32)
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        kept = jnp.where((before < top_p) | (top_p >= 1), ordered, jnp.inf)
        logits = jnp.where(logits < kept.min(axis=-1, keepdims=True), -jnp.inf, logits)
    return logits


def _per_row(value: jax.Array | float, dtype: jnp.dtype) -> jax.Array:
    """A scalar or ``[batch]`` parameter as ``[batch or 1, 1]``, to broadcast over logits."""
    return jnp.asarray(value, dtype).reshape(-1, 1)


@functools.partial(jax.jit, static_argnames="sampling")
def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """``[batch]`` int32 next tokens for ``logits [batch, vocab]``."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, sampling)).astype(jnp.int32)


def sample_rows(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> jax.Array:
    """``[batch]`` int32 next tokens for ``logits [batch, vocab]``, each row by its own
    parameters (`filter_rows`, ``[batch]`` each) and key (``keys [batch]``): greedy where its
    temperature is 0. The full sort is taken only where a row needs it (module doc)."""
    greedy = temperature == 0
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.lax.cond(
        jnp.all(greedy),
        lambda: best,
        lambda: _draw(logits, keys, jnp.where(greedy, 1.0, temperature), top_k, top_p),
    )
    return jnp.where(greedy, best, drawn)


def _draw(logits, keys, temperature, top_k, top_p):
    """One token per row drawn from `filter_rows`'s distribution (module doc)."""
    scaled = logits.astype(jnp.float32) / _per_row(temperature, jnp.float32)
    vocab = scaled.shape[-1]
    count = min(PREFILTER, vocab)
    values, indices = jax.lax.top_k(scaled, count)  # [batch, count], most likely first
    mass = jnp.exp(values - jax.nn.logsumexp(scaled, axis=-1, keepdims=True)).sum(-1)
    whole_vocab = top_k >= vocab
    by_top_k = ~whole_vocab & (top_k <= count)
    by_top_p = whole_vocab & (top_p < 1) & (mass >= top_p)
    prefiltered = by_top_k | by_top_p
    past_candidates = ~prefiltered & ~(whole_vocab & (top_p >= 1))
    # over the candidates, top-p alone renormalises by their mass: top_p / mass keeps the same
    candidate_top_p = jnp.where(by_top_p, jnp.minimum(top_p / mass, 1.0), top_p)
    kept = filter_rows(values, 1.0, jnp.minimum(top_k, count), candidate_top_p)
    from_candidates = jnp.take_along_axis(
        indices, jax.vmap(jax.random.categorical)(keys, kept)[:, None], axis=-1
    )[:, 0]
    whole = jax.lax.cond(
        jnp.any(past_candidates), lambda: filter_rows(scaled, 1.0, top_k, top_p), lambda: scaled
    )
    from_whole = jax.vmap(jax.random.categorical)(keys, whole)
    return jnp.where(prefiltered, from_candidates, from_whole).astype(jnp.int32)
