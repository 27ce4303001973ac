"""Validation of ``pf.decode``'s query, cache and lengths (`DecodeCache` gives the layouts).

Shapes and dtypes are always checked. Values (lengths in range, page indices in range) are
checked when they are concrete; traced ones (under ``jax.jit``) cannot be, and backends clip
them so that nothing outside the cache is read.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash.decode_cache import DecodeCache
from pallas_flash.kv_packing import PACKED_DTYPE, packable
from pallas_flash.validation import (
    AttentionDims,
    check_float_dtypes,
    check_heads,
    check_rank,
    fail,
)

CONTIGUOUS = "[batch, kv_heads, max_len, head_dim]"
PAGED = "[num_pages, kv_heads, page_size, head_dim]"


def concrete(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array, or None when it is traced."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_cache_arrays(q: Any, cache: DecodeCache, layout: str) -> None:
    """Ranks, shapes and dtypes of k, v and their scales against q."""
    check_rank("k_cache", cache.k, 4, layout)
    if cache.packed:
        _check_packed(q, cache, layout)
        return
    check_rank("v_cache", cache.v, 4, layout)
    k_shape = tuple(jnp.shape(cache.k))
    if tuple(jnp.shape(cache.v)) != k_shape:
        raise fail(
            "v_cache", f"shape {tuple(jnp.shape(cache.v))}", f"the shape of k_cache, {k_shape}"
        )
    _check_k_heads(q, cache)
    if jnp.int8 in (jnp.result_type(cache.k), jnp.result_type(cache.v)):
        _check_int8(q, cache, layout)
        return
    check_float_dtypes(("q", "k_cache", "v_cache"), (q, cache.k, cache.v))
    for name, scales in (("k_scales", cache.k_scales), ("v_scales", cache.v_scales)):
        if scales is not None:
            dtype = jnp.result_type(cache.k)
            raise fail(name, f"scales for a {dtype} cache", "None (scales go with an int8 cache)")


def _check_k_heads(q: Any, cache: DecodeCache) -> None:
    """k's ``head_dim`` is q's, and its kv heads divide q's heads."""
    _, q_heads, head_dim = jnp.shape(q)
    k_shape = tuple(jnp.shape(cache.k))
    if k_shape[3] != head_dim:
        raise fail("k_cache", f"shape {k_shape}", f"head_dim {head_dim} (from q)")
    check_heads("k_cache", q_heads, k_shape[1])


def _check_packed(q: Any, cache: DecodeCache, layout: str) -> None:
    """A packed cache (``v_cache`` None): paged, uint32 of q's head_dim, q 16-bit, no
    scales."""
    if layout != PAGED:
        raise fail("v_cache", "None (a packed cache)", f"{layout} (only a paged cache packs: "
                   "give page_table)")  # fmt: skip
    if jnp.result_type(cache.k) != PACKED_DTYPE:
        raise fail("k_cache", f"dtype {jnp.result_type(cache.k)} with v_cache None",
                   "uint32 (keys and values packed by pf.pack_kv), or v_cache given")  # fmt: skip
    if not packable(jnp.result_type(q)):
        raise fail("q", f"dtype {jnp.result_type(q)} with a packed cache",
                   "bfloat16 or float16 (a packed cache holds 16-bit keys and values)")  # fmt: skip
    _check_k_heads(q, cache)
    for name, scales in (("k_scales", cache.k_scales), ("v_scales", cache.v_scales)):
        if scales is not None:
            raise fail(name, "scales for a packed cache", "None (scales go with an int8 cache)")


def _check_int8(q: Any, cache: DecodeCache, layout: str) -> None:
    """An int8 cache: both caches int8, a float q, float32 scales of the cache's shape
    without ``head_dim``."""
    check_float_dtypes(("q",), (q,))
    for name, x in (("k_cache", cache.k), ("v_cache", cache.v)):
        if jnp.result_type(x) != jnp.int8:
            raise fail(name, f"dtype {jnp.result_type(x)}", "int8 (an int8 cache: k, v and scales)")
    expected = tuple(jnp.shape(cache.k))[:3]
    scales_layout = layout.replace(", head_dim]", "]")
    for name, scales in (("k_scales", cache.k_scales), ("v_scales", cache.v_scales)):
        text = f"float32 {scales_layout} of shape {expected} for an int8 cache"
        if scales is None:
            raise fail(name, "None", text)
        if tuple(jnp.shape(scales)) != expected:
            raise fail(name, f"shape {tuple(jnp.shape(scales))}", text)
        if jnp.result_type(scales) != jnp.float32:
            raise fail(name, f"dtype {jnp.result_type(scales)}", text)


def _check_lengths(
    lengths: Any, batch: int, max_len: int, room: str, name: str = "lengths"
) -> np.ndarray | None:
    """Shape, dtype and (when concrete) range of lengths (the argument ``name``); returns their
    values if concrete."""
    if tuple(jnp.shape(lengths)) != (batch,):
        raise fail(name, f"shape {tuple(jnp.shape(lengths))}", f"shape ({batch},) [batch]")
    if not jnp.issubdtype(jnp.result_type(lengths), jnp.integer):
        raise fail(name, f"dtype {jnp.result_type(lengths)}", "an integer dtype (int32)")
    values = concrete(lengths)
    if values is not None and ((values < 0) | (values > max_len)).any():
        raise fail(name, f"values {values.tolist()}", f"values in [0, {room}]")
    return values


def check_page_table(
    page_table: Any, batch: int, num_pages: int, page_size: int, lengths: Any,
    *, name: str = "lengths",
) -> None:  # fmt: skip
    """The table's shape and dtype and, when it and lengths (the argument ``name``) are
    concrete, that every page a sequence's length uses is a page of the cache."""
    check_rank("page_table", page_table, 2, "[batch, pages_per_sequence]")
    shape = tuple(jnp.shape(page_table))
    if shape[0] != batch:
        raise fail("page_table", f"shape {shape}", f"batch {batch} (from q)")
    if not jnp.issubdtype(jnp.result_type(page_table), jnp.integer):
        raise fail("page_table", f"dtype {jnp.result_type(page_table)}", "an integer dtype (int32)")
    max_len = shape[1] * page_size
    room = f"{max_len}: pages_per_sequence={shape[1]} x page_size={page_size}"
    values = _check_lengths(lengths, batch, max_len, room, name)
    table = concrete(page_table)
    if values is None or table is None:
        return
    used = np.arange(shape[1])[None, :] < -(-values[:, None] // page_size)  # ceil division
    bad = np.argwhere(used & ((table < 0) | (table >= num_pages)))
    if bad.size:
        b, j = bad[0]
        raise fail(
            "page_table",
            f"page {int(table[b, j])} at [{b}, {j}] ({len(bad)} out of range)",
            f"indices in [0, num_pages={num_pages}) for every page that {name} use",
        )


def check_decode(q: Any, cache: DecodeCache, lengths: Any) -> AttentionDims:
    """Checks decode inputs; returns the sizes with ``q_len = 1`` and ``kv_len`` the
    positions one sequence can hold (``max_len``)."""
    check_rank("q", q, 3, "[batch, q_heads, head_dim]")
    batch, q_heads, head_dim = jnp.shape(q)
    layout = CONTIGUOUS if cache.page_table is None else PAGED
    check_cache_arrays(q, cache, layout)
    k_shape = tuple(jnp.shape(cache.k))
    if cache.page_table is None:
        if k_shape[0] != batch:
            raise fail("k_cache", f"shape {k_shape}", f"batch {batch} (from q)")
        max_len = k_shape[2]
        _check_lengths(lengths, batch, max_len, f"max_len={max_len}")
    else:
        check_page_table(cache.page_table, batch, k_shape[0], k_shape[2], lengths)
        max_len = jnp.shape(cache.page_table)[1] * k_shape[2]
    return AttentionDims(batch, q_heads, 1, k_shape[1], max_len, head_dim, head_dim)
