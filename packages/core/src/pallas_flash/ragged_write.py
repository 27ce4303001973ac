"""The new tokens of a ragged batch (`pallas_flash.ragged_batch`) written into their pages:
what `pf.ragged_attention` does before a backend's kernel reads the cache, unless the backend's
kernel writes them itself (`pallas_flash.Backend.ragged_attention_and_write`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash.cache_write import Arrays, write_kv_arrays, write_tokens
from pallas_flash.decode_cache import DecodeCache
from pallas_flash.ragged_batch import token_places


def write_new_tokens(
    cache: DecodeCache, k: jax.Array, v: jax.Array, query_starts: jax.Array, kv_lengths: jax.Array
) -> DecodeCache:
    """``cache`` with each valid row of ``k``, ``v`` ``[tokens, kv_heads, head_dim]`` written
    at its sequence's position (`pallas_flash.ragged_batch`); padding rows and rows whose page
    is out of range are written nowhere."""
    page_size = cache.k.shape[2]
    pages, rows = token_pages(cache.page_table, page_size, query_starts, kv_lengths, k.shape[0])
    seqs = kv_lengths.shape[0]

    def write_arrays(arrays: Arrays, values: Arrays) -> Arrays:
        return write_tokens(arrays, values, pages, rows, sequences=seqs)

    return write_kv_arrays(cache, k, v, write_arrays)


def token_pages(
    page_table: jax.Array,
    page_size: int,
    query_starts: jax.Array,
    kv_lengths: jax.Array,
    tokens: int,
) -> tuple[jax.Array, jax.Array]:
    """``pages``, ``rows`` ``[tokens]`` int32: the page and row each of a ragged batch's
    ``tokens`` rows is written at (`pallas_flash.ragged_attention`'s arguments); -1 for padding
    rows and rows past a sequence's pages."""
    pages_per_sequence = page_table.shape[1]
    places = token_places(query_starts, kv_lengths, tokens)
    column = places.position // page_size
    inside = places.valid & (places.position >= 0) & (column < pages_per_sequence)
    page = page_table[places.sequence, jnp.clip(column, 0, pages_per_sequence - 1)]
    return jnp.where(inside, page, -1), places.position % page_size
