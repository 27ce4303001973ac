"""``check_decode``: contiguous and paged caches, float, int8 and packed, concrete and traced
values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash.decode_validation import check_decode
from pallas_flash.validation import AttentionDims

DQ, CACHE = jnp.zeros((2, 4, 8)), jnp.zeros((2, 2, 6, 8))
PAGES = jnp.zeros((5, 2, 4, 8))  # 5 pages of 4 positions
TABLE = jnp.array([[3, 0], [4, 1]], jnp.int32)  # 2 pages (8 positions) per sequence
INT8, SCALES = jnp.zeros((2, 2, 6, 8), jnp.int8), jnp.zeros((2, 2, 6))


def _cache(k=CACHE, v=None, page_table=None, k_scales=None, v_scales=None) -> pf.DecodeCache:
    return pf.DecodeCache(k, k if v is None else v, page_table, k_scales, v_scales)


def test_returns_the_sizes():
    dims = check_decode(DQ, _cache(), jnp.array([0, 6]))
    assert dims == AttentionDims(
        batch=2, q_heads=4, q_len=1, kv_heads=2, kv_len=6, head_dim=8, v_head_dim=8
    )


def test_paged_sizes_count_the_table_s_positions():
    dims = check_decode(DQ, _cache(PAGES, page_table=TABLE), jnp.array([0, 8]))
    assert dims == AttentionDims(
        batch=2, q_heads=4, q_len=1, kv_heads=2, kv_len=8, head_dim=8, v_head_dim=8
    )


def test_int8_with_scales_is_accepted():
    dims = check_decode(DQ, _cache(INT8, k_scales=SCALES, v_scales=SCALES), jnp.array([1, 6]))
    assert dims.kv_len == 6


@pytest.mark.parametrize(
    ("q", "cache", "lengths", "name", "got"),
    [
        (DQ[None], _cache(), [1, 1], "q", "rank 3 [batch, q_heads, head_dim], got shape"),
        (DQ, _cache(CACHE[0]), [1, 1], "k_cache", "[batch, kv_heads, max_len, head_dim], got"),
        (DQ, _cache(v=CACHE[:, :, :5]), [1, 1], "v_cache", "got shape (2, 2, 5, 8)"),
        (DQ, _cache(CACHE[:1]), [1, 1], "k_cache", "batch 2 (from q), got shape (1, 2, 6, 8)"),
        (DQ, _cache(CACHE[..., :4]), [1, 1], "k_cache", "head_dim 8 (from q)"),
        (DQ[:, :3], _cache(), [1, 1], "k_cache", "got 2 kv heads for 3 query heads"),
        (DQ, _cache(CACHE.astype(jnp.bfloat16), CACHE), [1, 1], "k_cache", "got dtype bfloat16"),
        (DQ, _cache(), [1, 1, 1], "lengths", "shape (2,) [batch], got shape (3,)"),
        (DQ, _cache(), [1.0, 2.0], "lengths", "an integer dtype (int32), got dtype float32"),
        (DQ, _cache(), [-1, 2], "lengths", "values in [0, max_len=6], got values [-1, 2]"),
        (DQ, _cache(), [1, 7], "lengths", "values in [0, max_len=6], got values [1, 7]"),
    ],
)
def test_contiguous_errors(q, cache, lengths, name, got, raises_invalid):
    with raises_invalid(name, got):
        check_decode(q, cache, jnp.asarray(lengths))


@pytest.mark.parametrize(
    ("cache", "lengths", "name", "got"),
    [
        (_cache(PAGES[0], page_table=TABLE), [1, 1], "k_cache", "[num_pages, kv_heads, page_size"),
        (_cache(PAGES, page_table=TABLE[0]), [1, 1], "page_table", "[batch, pages_per_sequence]"),
        (_cache(PAGES, page_table=TABLE[:1]), [1], "page_table", "batch 2 (from q)"),
        (_cache(PAGES, page_table=TABLE * 1.0), [1, 1], "page_table", "integer dtype"),
        # a table shorter than a length needs
        (_cache(PAGES, page_table=TABLE), [9, 1], "lengths", "[0, 8: pages_per_sequence=2 x "),
        # a page index out of range, in a page the lengths use
        (_cache(PAGES, page_table=TABLE.at[1, 1].set(5)), [0, 5], "page_table", "page 5 at [1, 1]"),
        (
            _cache(PAGES, page_table=TABLE.at[0, 0].set(-1)),
            [1, 0],
            "page_table",
            "page -1 at [0, 0]",
        ),
    ],
)
def test_paged_errors(cache, lengths, name, got, raises_invalid):
    with raises_invalid(name, got):
        check_decode(DQ, cache, jnp.asarray(lengths))


def test_pages_past_the_lengths_may_hold_any_index():
    """Entries a sequence's length does not reach are never read (e.g. -1 as padding)."""
    table = jnp.array([[3, -1], [-1, 99]], jnp.int32)
    check_decode(DQ, _cache(PAGES, page_table=table), jnp.array([4, 0]))


@pytest.mark.parametrize(
    ("cache", "name", "got"),
    [
        (_cache(INT8), "k_scales", "float32 [batch, kv_heads, max_len] of shape (2, 2, 6)"),
        (_cache(INT8, k_scales=SCALES), "v_scales", "got None"),
        (
            _cache(INT8, k_scales=SCALES[..., :5], v_scales=SCALES),
            "k_scales",
            "got shape (2, 2, 5)",
        ),
        (
            _cache(INT8, k_scales=SCALES, v_scales=SCALES[None]),
            "v_scales",
            "got shape (1, 2, 2, 6)",
        ),
        (
            _cache(INT8, k_scales=SCALES.astype(jnp.bfloat16), v_scales=SCALES),
            "k_scales",
            "bfloat16",
        ),
        (_cache(INT8, CACHE, k_scales=SCALES, v_scales=SCALES), "v_cache", "int8"),
        (_cache(k_scales=SCALES, v_scales=SCALES), "k_scales", "got scales for a float32 cache"),
        (
            _cache(PAGES.astype(jnp.int8), page_table=TABLE, k_scales=SCALES, v_scales=SCALES),
            "k_scales",
            "[num_pages, kv_heads, page_size] of shape (5, 2, 4)",
        ),
    ],
)
def test_int8_errors(cache, name, got, raises_invalid):
    with raises_invalid(name, got):
        check_decode(DQ, cache, jnp.array([1, 1]))


def test_int8_cache_needs_a_float_query(raises_invalid):
    cache = _cache(INT8, k_scales=SCALES, v_scales=SCALES)
    with raises_invalid("q", "a floating dtype"):
        check_decode(DQ.astype(jnp.int8), cache, jnp.array([1, 1]))


WORDS = jnp.zeros((5, 2, 4, 8), jnp.uint32)  # a packed pool: keys and values in one array
BF16_Q = DQ.astype(jnp.bfloat16)


def test_a_packed_pool_is_accepted_for_a_16_bit_query():
    cache = pf.DecodeCache(WORDS, None, TABLE)
    assert cache.packed
    assert check_decode(BF16_Q, cache, jnp.array([1, 8])).kv_len == 8
    assert check_decode(DQ.astype(jnp.float16), cache, jnp.array([1, 8])).kv_len == 8


@pytest.mark.parametrize(
    ("q", "cache", "name", "got"),
    [
        (BF16_Q, pf.DecodeCache(WORDS[:2, :, :2], None), "v_cache",
         "(only a paged cache packs: give page_table), got None (a packed cache)"),
        (BF16_Q, pf.DecodeCache(WORDS.astype(jnp.bfloat16), None, TABLE), "k_cache",
         "uint32 (keys and values packed by pf.pack_kv), or v_cache given, got dtype bfloat16"),
        (DQ, pf.DecodeCache(WORDS, None, TABLE), "q", "bfloat16 or float16"),
        (BF16_Q, pf.DecodeCache(WORDS[..., :4], None, TABLE), "k_cache", "head_dim 8 (from q)"),
        (BF16_Q[:, :3], pf.DecodeCache(WORDS, None, TABLE), "k_cache", "2 kv heads for 3"),
        (BF16_Q, pf.DecodeCache(WORDS, None, TABLE, SCALES, SCALES), "k_scales",
         "None (scales go with an int8 cache)"),
    ],
)  # fmt: skip
def test_packed_errors(q, cache, name, got, raises_invalid):
    with raises_invalid(name, got):
        check_decode(q, cache, jnp.array([1, 1]))


def test_traced_lengths_and_table_are_not_range_checked():
    @jax.jit
    def traced(lengths, table):
        dims = check_decode(DQ, _cache(PAGES, page_table=table), lengths)
        return lengths + dims.kv_len

    np.testing.assert_array_equal(traced(jnp.array([-1, 9]), TABLE + 10), [7, 17])


def test_shapes_of_traced_lengths_are_still_checked(raises_invalid):
    @jax.jit
    def traced(lengths):
        return check_decode(DQ, _cache(), lengths).kv_len

    with raises_invalid("lengths", "got shape (3,)"):
        traced(jnp.array([1, 2, 3]))
