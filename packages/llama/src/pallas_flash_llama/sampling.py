"""Choosing the next token from logits: greedy, temperature, top-k and top-p."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import pallas_flash as pf


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
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        kept = jnp.where(before < sampling.top_p, ordered, jnp.inf)
        logits = jnp.where(logits < kept.min(axis=-1, keepdims=True), -jnp.inf, logits)
    return logits


@functools.partial(jax.jit, static_argnames="sampling")
def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """``[batch]`` int32 next tokens for ``logits [batch, vocab]``."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, sampling)).astype(jnp.int32)
