"""Log-probabilities of tokens under the model, as the OpenAI API's ``logprobs`` report them.

A token's logprob is the log-softmax of the model's raw logits at the position before it
(vLLM's default, ``logprobs_mode="raw_logprobs"``: before temperature, top-k or top-p), in
float32; the ``top`` alternatives are the most likely tokens there, most likely first. The
engine computes them in a step program of their own (`engine_step.step_program` with
``logprobs=True``), compiled the first time a request asks: a sampled token's for a request
with ``logprobs``, and each prompt token's after the first for one with ``prompt_logprobs``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20
"""The most alternatives a token's logprob carries (vLLM's default ``max_logprobs``)."""


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """``token``'s logprob, its ``rank`` among the vocabulary at its position (1: the most
    likely; tokens more likely than it, plus one) and the ``top`` ``(token, logprob)``
    alternatives there, most likely first (as many as asked, up to `MAX_LOGPROBS`)."""

    token: int
    logprob: float
    rank: int = 1
    top: tuple[tuple[int, float], ...] = ()


class RowLogprobs(NamedTuple):
    """Per row of logits: the logprob and rank of a chosen token (``[rows]`` each) and the
    `MAX_LOGPROBS` most likely tokens and their logprobs (``[rows, MAX_LOGPROBS]`` each)."""

    chosen: jax.Array
    rank: jax.Array
    top_tokens: jax.Array
    top_logprobs: jax.Array


def row_logprobs(logits: jax.Array, chosen: jax.Array) -> RowLogprobs:
    """`RowLogprobs` of ``logits [rows, vocab]`` for the ``chosen [rows]`` int32 tokens (a
    negative one scores nothing: 0)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logprobs, jnp.maximum(chosen, 0)[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(logprobs > picked[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_tokens = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    return RowLogprobs(jnp.where(chosen >= 0, picked, 0.0), rank, top_tokens, top_logprobs)


def token_logprob(found: RowLogprobs, row: int, token: int, count: int) -> TokenLogprob:
    """Row ``row`` of host (numpy) `RowLogprobs` as ``token``'s `TokenLogprob` with ``count``
    alternatives."""
    top = zip(found.top_tokens[row, :count].tolist(), found.top_logprobs[row, :count].tolist(),
              strict=True)  # fmt: skip
    return TokenLogprob(token, float(found.chosen[row]), int(found.rank[row]), tuple(top))
