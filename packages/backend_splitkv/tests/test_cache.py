"""`KVCache`: appends land at each sequence's length, in place, and decode reads them."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs, reference
from pallas_flash_splitkv import KVCache


def with_lengths(cache: KVCache, lengths: list[int]) -> KVCache:
    return KVCache(cache.k, cache.v, jnp.asarray(lengths, jnp.int32))


def test_appends_write_at_each_length_in_place() -> None:
    cache = KVCache.empty(2, 2, 8, 64, jnp.float32)
    cache = with_lengths(cache, [3, 0])
    k_new, v_new = inputs.normal(0, (2, 2, 64)), inputs.normal(1, (2, 2, 64))
    old_k = cache.k
    cache = cache.append(k_new, v_new)
    assert old_k.is_deleted(), "the old cache must be donated (updated in place)"
    np.testing.assert_array_equal(cache.lengths, [4, 1])
    np.testing.assert_array_equal(cache.k[0, :, 3], k_new[0])
    np.testing.assert_array_equal(cache.v[1, :, 0], v_new[1])
    assert (np.asarray(cache.k[0, :, 4:]) == 0).all() and (np.asarray(cache.k[1, :, 1:]) == 0).all()


def test_a_decode_loop_matches_the_reference() -> None:
    cache = KVCache.empty(1, 1, 16, 64, jnp.float32)
    keys, values = inputs.normal(2, (1, 1, 5, 64)), inputs.normal(3, (1, 1, 5, 64))
    for t in range(5):
        cache = cache.append(keys[:, :, t], values[:, :, t])
    q = inputs.normal(4, (1, 2, 64))
    out = cache.decode(q, backend="xla")
    expected = reference.decode(
        q,
        np.asarray(cache.k),
        np.asarray(cache.v),
        np.asarray(cache.lengths),
        sm_scale=1 / math.sqrt(64),
    )
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


def test_appending_to_a_full_sequence_raises() -> None:
    cache = with_lengths(KVCache.empty(2, 1, 4, 64, jnp.float32), [4, 1])
    with pytest.raises(pf.InvalidInputError, match=r"lengths: .*full sequences \[0\]"):
        cache.append(jnp.ones((2, 1, 64)), jnp.ones((2, 1, 64)))


def test_under_a_trace_a_full_sequence_is_left_unchanged() -> None:
    cache = with_lengths(KVCache.empty(2, 1, 4, 64, jnp.float32), [4, 1])
    before = np.asarray(cache.k)
    cache = jax.jit(lambda c, k, v: c.append(k, v))(
        cache, jnp.ones((2, 1, 64)), jnp.ones((2, 1, 64))
    )
    np.testing.assert_array_equal(cache.lengths, [4, 2])
    np.testing.assert_array_equal(cache.k[0], before[0])


def test_wrong_token_shape_raises() -> None:
    cache = KVCache.empty(2, 1, 4, 64, jnp.float32)
    with pytest.raises(pf.InvalidInputError, match=r"k_new: expected shape \(2, 1, 64\)"):
        cache.append(jnp.ones((2, 64)), jnp.ones((2, 1, 64)))


def test_an_int8_cache_quantizes_on_append_in_place_and_decodes() -> None:
    cache = KVCache.empty(2, 2, 8, 64, jnp.int8)
    assert cache.k.dtype == jnp.int8 and cache.k_scales.shape == (2, 2, 8)
    keys, values = inputs.normal(5, (2, 2, 3, 64)), inputs.normal(6, (2, 2, 3, 64))
    for t in range(3):
        old_scales = cache.k_scales
        cache = cache.append(keys[:, :, t], values[:, :, t])
        assert old_scales.is_deleted(), "the scales are donated too"
    k8, k_scales = pf.quantize_int8(keys)
    np.testing.assert_array_equal(cache.k[:, :, :3], k8)
    np.testing.assert_array_equal(cache.k_scales[:, :, :3], k_scales)
    q = inputs.normal(7, (2, 4, 64))
    expected = reference.decode(
        q, keys, values, np.array([3, 3]), sm_scale=1 / math.sqrt(64)
    )  # the float cache: int8 costs under 1% here
    np.testing.assert_allclose(cache.decode(q, backend="splitkv"), expected, atol=2e-2)
