"""The training loss: mean next-token cross-entropy of packed sequences, in float32.

The logits of a 128k vocabulary are the largest activation of a small model's step (float32
``[batch, seq, vocab]``: 2.1 GB for 2 sequences of 2048 tokens of Llama-3's vocabulary, and
as much again for their gradient). With ``config.loss_chunk`` the loss makes them a chunk
of positions at a time under ``lax.scan``, each chunk's logits recomputed in the backward
(``jax.checkpoint``), so only one chunk's exist at once; the result is the same sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import pallas_flash as pf
from pallas_flash_llama import sharding
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.model import Params, unembed


def next_token_loss(
    params: Params,
    x: jax.Array,
    tokens: jax.Array,
    segment_ids: jax.Array,
    config: LlamaConfig,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy of each token's successor over the tokens whose successor is in the
    same document, and how many tokens that is.

    Args:
      params: the model's parameters (the final norm and output projection are read).
      x: ``[batch, seq, hidden]`` the last layer's output (`model.hidden_states`).
      tokens: ``[batch, seq]`` int32.
      segment_ids: ``[batch, seq]`` int32 document ids (0: padding).

    Raises:
      pf.InvalidInputError: ``config.loss_chunk`` does not divide the sequence length.
    """
    batch, seq = tokens.shape
    chunk = seq if config.loss_chunk is None else config.loss_chunk
    if seq % chunk:
        raise pf.InvalidInputError(
            f"loss_chunk: expected a divisor of the sequence length {seq}, got {chunk}"
        )
    # position p predicts token p + 1; the last position predicts nothing
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    counted = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    counted = jnp.pad(counted, ((0, 0), (0, 1)))

    def nll(x: jax.Array, targets: jax.Array, counted: jax.Array) -> jax.Array:
        logits = unembed(params, x, config)
        logits = sharding.constrain(logits, ("batch", "seq", "act_vocab"), mesh)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.where(counted, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0).sum()

    if config.loss_chunk is None:
        total = nll(x, targets, counted)
    else:
        chunk_nll = jax.checkpoint(nll)  # the backward remakes each chunk's logits

        def chunks(a: jax.Array) -> jax.Array:
            """``[batch, seq, ...]`` as ``[seq / chunk, batch, chunk, ...]``."""
            return jnp.moveaxis(a.reshape(batch, seq // chunk, chunk, *a.shape[2:]), 1, 0)

        def add(total: jax.Array, part: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
            return total + chunk_nll(*part), None

        parts = (chunks(x), chunks(targets), chunks(counted))
        total, _ = jax.lax.scan(add, jnp.zeros((), jnp.float32), parts)
    count = counted.sum()
    return total / jnp.maximum(count, 1), count
