"""Tests of the decode cache helpers: `pf.zeros_cache` and `pf.write_token` (one device; the
split write and the TPU layout are covered by the splitkv and llama tests)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf

SHAPE = (3, 2, 16, 8)  # [batch, kv_heads, max_len, head_dim]


def test_zeros_cache_is_a_row_major_zero_array_on_the_given_device() -> None:
    device = jax.devices()[-1]
    cache = pf.zeros_cache(SHAPE, jnp.bfloat16, jax.sharding.SingleDeviceSharding(device))
    assert cache.shape == SHAPE and cache.dtype == jnp.bfloat16
    assert cache.devices() == {device}
    assert cache.format.layout.major_to_minor == (0, 1, 2, 3)
    assert not np.asarray(cache, np.float32).any()


def test_write_token_writes_each_sequence_at_its_position_and_skips_out_of_range() -> None:
    cache = jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE), jnp.float32)
    row = jnp.asarray(np.random.default_rng(1).standard_normal((3, 2, 8)), jnp.float32)
    positions = jnp.asarray([0, 15, 16], jnp.int32)  # first, last, past the end

    written = jax.jit(pf.write_token)(cache, row, positions)

    expected = np.array(cache)
    expected[0, :, 0] = row[0]
    expected[1, :, 15] = row[1]
    np.testing.assert_array_equal(written, expected)


def test_write_token_under_donation_keeps_the_cache_format() -> None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    cache = pf.zeros_cache(SHAPE, jnp.float32, sharding)
    write = jax.jit(pf.write_token, donate_argnums=0, out_shardings=pf.cache_format(sharding))

    written = write(cache, jnp.ones((3, 2, 8), jnp.float32), jnp.asarray([1, 2, 3], jnp.int32))

    assert cache.is_deleted()
    assert written.format.layout.major_to_minor == (0, 1, 2, 3)
    assert written.sharding == sharding
    expected = np.zeros(SHAPE, np.float32)
    for b, position in enumerate((1, 2, 3)):
        expected[b, :, position] = 1
    np.testing.assert_array_equal(written, expected)


def test_kept_format_is_the_cache_s_own_placement_row_major_and_none_when_traced() -> None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[-1])
    kept = pf.kept_format(pf.zeros_cache(SHAPE, jnp.float32, sharding))
    assert kept.sharding == sharding and kept.layout.major_to_minor == (0, 1, 2, 3)
    traced = []
    jax.jit(lambda x: traced.append(pf.kept_format(x)))(jnp.zeros(SHAPE))
    assert traced == [None]
