"""Validation of ``pf.ragged_attention``'s tokens, paged cache and batch layout
(`pallas_flash.ragged_batch`).

Shapes and dtypes are always checked; values (the starts' order, lengths in range, pages in
range) when they are concrete. Traced values cannot be checked: backends clip them so that
nothing outside the cache is read, and a token whose page is out of range is written nowhere.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_flash.decode_cache import DecodeCache
from pallas_flash.decode_validation import PAGED, check_cache_arrays, check_page_table, concrete
from pallas_flash.validation import AttentionDims, check_rank, fail


def _check_new_kv(q: Any, k: Any, v: Any, kv_heads: int) -> None:
    """k and v ``[tokens, kv_heads, head_dim]``, q's tokens, head_dim and dtype."""
    tokens, _, head_dim = jnp.shape(q)
    expected = (tokens, kv_heads, head_dim)
    for name, x in (("k", k), ("v", v)):
        check_rank(name, x, 3, "[tokens, kv_heads, head_dim]")
        if tuple(jnp.shape(x)) != expected:
            raise fail(name, f"shape {tuple(jnp.shape(x))}", f"shape {expected} (q's tokens and "
                       "head_dim, the cache's kv_heads)")  # fmt: skip
        if jnp.result_type(x) != jnp.result_type(q):
            raise fail(name, f"dtype {jnp.result_type(x)}", f"q's dtype {jnp.result_type(q)}")


def _check_starts(query_starts: Any, seqs: int, tokens: int) -> np.ndarray | None:
    """Shape, dtype and (when concrete) order of query_starts; returns their values."""
    if tuple(jnp.shape(query_starts)) != (seqs + 1,):
        raise fail("query_starts", f"shape {tuple(jnp.shape(query_starts))}",
                   f"shape ({seqs + 1},) [seqs + 1] (seqs from page_table)")  # fmt: skip
    if not jnp.issubdtype(jnp.result_type(query_starts), jnp.integer):
        raise fail("query_starts", f"dtype {jnp.result_type(query_starts)}", "an integer dtype")
    values = concrete(query_starts)
    if values is None:
        return None
    if values[0] != 0 or (np.diff(values) < 0).any() or values[-1] > tokens:
        raise fail("query_starts", f"values {values.tolist()}",
                   f"non-decreasing values from 0 to at most the {tokens} tokens")  # fmt: skip
    return values


def check_ragged(
    q: Any, k: Any, v: Any, cache: DecodeCache, query_starts: Any, kv_lengths: Any
) -> AttentionDims:
    """Checks ragged inputs; returns the sizes with ``batch`` the sequences, ``q_len`` the
    tokens and ``kv_len`` the positions one sequence can hold."""
    check_rank("q", q, 3, "[tokens, q_heads, head_dim]")
    tokens, q_heads, head_dim = jnp.shape(q)
    check_cache_arrays(q, cache, PAGED)
    num_pages, kv_heads, page_size, _ = jnp.shape(cache.k)
    _check_new_kv(q, k, v, kv_heads)
    check_rank("page_table", cache.page_table, 2, "[seqs, pages_per_sequence]")
    seqs, pages_per_sequence = jnp.shape(cache.page_table)
    starts = _check_starts(query_starts, seqs, tokens)
    check_page_table(cache.page_table, seqs, num_pages, page_size, kv_lengths, name="kv_lengths")
    lengths = concrete(kv_lengths)
    if starts is not None and lengths is not None and (lengths < np.diff(starts)).any():
        raise fail("kv_lengths", f"values {lengths.tolist()}",
                   f"at least each sequence's new tokens, {np.diff(starts).tolist()} "
                   "(from query_starts)")  # fmt: skip
    max_len = pages_per_sequence * page_size
    return AttentionDims(seqs, q_heads, tokens, kv_heads, max_len, head_dim, head_dim)
