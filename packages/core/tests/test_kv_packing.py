"""`pallas_flash.kv_packing`: keys and values packed into 32-bit words and back, every bit
kept (NaN, infinities, signed zeros, subnormals), for bfloat16 and float16."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash.kv_packing import packable


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_every_16_bit_pattern_round_trips(dtype) -> None:
    bits = np.arange(2**16, dtype=np.uint16)  # every pattern: NaN, inf, -0, subnormals
    k = jnp.asarray(bits).view(dtype).reshape(2, 8, 32, 128)
    v = jnp.asarray(bits[::-1].copy()).view(dtype).reshape(2, 8, 32, 128)
    words = pf.pack_kv(k, v)
    assert words.dtype == jnp.uint32 and words.shape == k.shape
    np.testing.assert_array_equal(np.asarray(words) & 0xFFFF, bits.reshape(k.shape))
    np.testing.assert_array_equal(np.asarray(words) >> 16, bits[::-1].reshape(k.shape))
    k_back, v_back = pf.unpack_kv(words, dtype)
    assert k_back.dtype == dtype and v_back.dtype == dtype
    for back, original in ((k_back, k), (v_back, v)):
        np.testing.assert_array_equal(
            np.asarray(back).view(np.uint16), np.asarray(original).view(np.uint16)
        )


def test_only_16_bit_floats_pack() -> None:
    assert packable(jnp.bfloat16) and packable("float16")
    assert not packable(jnp.float32) and not packable(jnp.int8) and not packable(jnp.int16)
