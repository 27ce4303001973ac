"""vLLM's sampling parameters that edit the logits before a token is drawn: ``logit_bias``,
``min_tokens``, the presence, frequency and repetition penalties, and ``min_p``.

Their definitions are vLLM's (``vllm/v1/sample/sampler.py``, ``ops/penalties.py``,
``logits_processor/builtin.py``), applied in its order to a slot's raw logits:
1. ``logit_bias`` adds its value to each token's logit; ``min_tokens``: until a request has
   generated that many tokens, its stop tokens' logits are -inf;
2. the repetition penalty divides a positive logit (multiplies a negative one) of every token
   in the prompt or the output by ``repetition_penalty``; then the frequency penalty takes
   ``frequency_penalty`` times its count in the output from each token's logit, and the
   presence penalty ``presence_penalty`` from each token in the output;
3. greedy slots take the argmax of these logits; the others divide them by the temperature,
   then ``min_p`` drops every token less likely than ``min_p`` times the most likely one
   (``logit / T < max / T + log(min_p)``), then top-k and top-p (`sampling`).

Only the tokens a slot edits are touched: the host lists them per slot (`LogitEdits`, the
union of the prompt's tokens, the output's, the biased ones and the stop tokens held back),
and the step scatters the edits into the logits. The engine runs them in its scoring step
program (`engine_step`), compiled the first time a request asks.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Collection, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf

Edited = dict[int, tuple[float, float, bool]]
"""``{token: (bias, count in the output, in the prompt or output)}``."""


@dataclasses.dataclass(frozen=True)
class LogitProcessing:
    """One request's logit edits (module doc); the defaults edit nothing."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if self.min_tokens < 0:
            raise pf.InvalidInputError(f"min_tokens: expected >= 0, got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise pf.InvalidInputError(f"{name}: expected -2 to 2, got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise pf.InvalidInputError(
                f"repetition_penalty: expected > 0, got {self.repetition_penalty}"
            )
        if not 0 <= self.min_p <= 1:
            raise pf.InvalidInputError(f"min_p: expected 0 to 1, got {self.min_p}")

    def tokens_edited(self, prompt: frozenset[int], output: Counter[int],
                      stop_ids: Collection[int]) -> Edited:  # fmt: skip
        """``{token: (bias, output count, in the prompt or output)}`` of the tokens a step
        edits for a request whose prompt holds the tokens ``prompt`` (kept by the caller for
        the request's steps) and that has generated ``output`` (counts), its ``stop_ids``
        held back while it has generated fewer than ``min_tokens``."""
        bias = dict(self.logit_bias)
        if sum(output.values()) < self.min_tokens:
            bias.update({token: -math.inf for token in stop_ids})
        seen = prompt.union(output) if self.repetition_penalty != 1 else set(output)
        return {t: (bias.get(t, 0.0), float(output.get(t, 0)), t in seen)
                for t in seen | set(bias)}  # fmt: skip


class LogitEdits(NamedTuple):
    """A step's edits (`LogitProcessing.tokens_edited`), per slot: ``tokens [slots, E]``
    int32 (-1: none), their ``bias``, output ``counts`` (float32) and ``seen`` (bool), and the
    slot's ``presence``, ``frequency``, ``repetition`` and ``min_p`` (``[slots]`` float32)."""

    tokens: jax.Array
    bias: jax.Array
    counts: jax.Array
    seen: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    min_p: jax.Array

    @classmethod
    def build(cls, slots: int, rows: Sequence[tuple[int, LogitProcessing, Edited]]) -> LogitEdits:
        """Host (numpy) edits for ``rows`` of ``(slot, processing, tokens_edited)``, their
        width the least power of two (at least 16) that holds each slot's tokens."""
        width = max([16, *(len(edited) for _, _, edited in rows)])
        width = 1 << (width - 1).bit_length()
        tokens = np.full((slots, width), -1, np.int32)
        bias, counts = np.zeros((slots, width), np.float32), np.zeros((slots, width), np.float32)
        seen = np.zeros((slots, width), bool)
        scalars = np.zeros((4, slots), np.float32)
        scalars[2] = 1.0  # no repetition penalty
        for slot, processing, edited in rows:
            for j, (token, (b, count, s)) in enumerate(sorted(edited.items())):
                tokens[slot, j], bias[slot, j], counts[slot, j], seen[slot, j] = token, b, count, s
            scalars[:, slot] = (processing.presence_penalty, processing.frequency_penalty,
                                processing.repetition_penalty, processing.min_p)  # fmt: skip
        return cls(tokens, bias, counts, seen, *scalars)


def apply_edits(logits: jax.Array, edits: LogitEdits, temperature: jax.Array) -> jax.Array:
    """``logits [slots, vocab]`` float32 with the edits applied (module doc, steps 1, 2 and
    ``min_p``; ``temperature [slots]``, 0 for a greedy slot, which ``min_p`` leaves)."""
    vocab = logits.shape[-1]
    rows = jnp.arange(logits.shape[0])[:, None]
    at = jnp.where(edits.tokens >= 0, edits.tokens, vocab)  # padding: out of bounds, dropped
    logits = logits.at[rows, at].add(edits.bias, mode="drop")
    picked = logits.at[rows, at].get(mode="fill", fill_value=0.0)
    repetition = edits.repetition[:, None]
    repeated = jnp.where(picked > 0, picked / repetition, picked * repetition)
    picked = jnp.where(edits.seen, repeated, picked)
    picked = picked - edits.frequency[:, None] * edits.counts
    picked = picked - edits.presence[:, None] * (edits.counts > 0)
    logits = logits.at[rows, at].set(picked, mode="drop")
    # min_p, after the temperature: logit / T >= max / T + log(min_p)
    floor = logits.max(axis=-1, keepdims=True) + temperature[:, None] * jnp.log(
        jnp.maximum(edits.min_p[:, None], 1e-30)
    )
    dropped = (edits.min_p[:, None] > 0) & (temperature[:, None] > 0) & (logits < floor)
    return jnp.where(dropped, -jnp.inf, logits)
