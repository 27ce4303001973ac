"""The flat token batch of a ragged attention call: which sequence and position each token is.

A ragged call packs the new tokens of many sequences into one axis, ``[tokens, ...]``:
sequence ``s`` owns rows ``query_starts[s] <= t < query_starts[s + 1]`` (1 for a decoding
sequence, a prompt's chunk for one being prefilled, 0 for an empty slot), and rows from
``query_starts[-1]`` on are padding. ``kv_lengths[s]`` counts the sequence's positions once
its new tokens are cached, so its ``n_s`` new tokens sit at positions ``kv_lengths[s] - n_s``
to ``kv_lengths[s] - 1``, each seeing the positions up to its own (causal).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TokenPlaces(NamedTuple):
    """Where each row of a ragged batch belongs (``[tokens]`` int32 / bool each).

    Attributes:
      sequence: the sequence the row belongs to (clipped into ``[0, seqs)`` for padding).
      position: its position in that sequence (0 for padding).
      valid: False for padding rows (past ``query_starts[-1]``).
    """

    sequence: jax.Array
    position: jax.Array
    valid: jax.Array


def token_places(query_starts: jax.Array, kv_lengths: jax.Array, tokens: int) -> TokenPlaces:
    """The sequence and position of each of ``tokens`` rows (module doc).

    Args:
      query_starts: ``[seqs + 1]`` int32, non-decreasing from 0.
      kv_lengths: ``[seqs]`` int32.
      tokens: rows in the batch.
    """
    rows = jnp.arange(tokens, dtype=jnp.int32)
    seqs = kv_lengths.shape[0]
    valid = rows < query_starts[-1]
    sequence = jnp.minimum(count_at_most(query_starts[1:], rows), seqs - 1)
    position = lookup(kv_lengths - query_starts[1:], sequence) + rows
    return TokenPlaces(sequence, jnp.where(valid, position, 0), valid)


def count_at_most(ends: jax.Array, values: jax.Array) -> jax.Array:
    """``[n]`` int32: how many of ``ends [m]`` (non-decreasing) are at most each of ``values
    [n]``, i.e. ``searchsorted(ends, values, side="right")``, by comparing all ``n x m`` pairs
    at once. XLA lowers a TPU searchsorted as a loop of gathers (about 6 cycles an element a
    step); the ``[n, m]`` compares of the batches here fill a few hundred vregs at most."""
    return jnp.sum(ends[None, :] <= values[:, None], axis=1, dtype=jnp.int32)


def lookup(table: jax.Array, index: jax.Array) -> jax.Array:
    """``table[index]`` for a short ``table [m]`` and ``index [n]`` in ``[0, m)``, by a
    one-hot ``[n, m]`` select and sum: XLA's TPU gather fetches element by element (about 6
    cycles each), which dominates the few ``[tokens]`` or ``[items]`` lookups of a step."""
    hot = index[:, None] == jnp.arange(table.shape[0], dtype=index.dtype)[None, :]
    return jnp.sum(jnp.where(hot, table[None, :], 0), axis=1, dtype=table.dtype)


def new_tokens(query_starts: jax.Array) -> jax.Array:
    """``[seqs]`` int32: each sequence's number of new tokens."""
    return query_starts[1:] - query_starts[:-1]
