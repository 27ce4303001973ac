"""`int8_rows`: the paired-row bfloat16 block and the scales in the same order are exact
permutations of the plain conversion (jit on the host: `pltpu.bitcast` and `pltpu.roll` have
the same meaning there as in a kernel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash_splitkv import int8_rows


def _order(positions: int) -> np.ndarray:
    return np.asarray(jax.jit(int8_rows.paired_order, static_argnums=0)(positions))[0]


def test_paired_order_is_a_perfect_shuffle_of_each_16_rows() -> None:
    order = _order(256)
    assert sorted(order) == list(range(256))
    assert list(order[16:32]) == [16, 24, 17, 25, 18, 26, 19, 27, 20, 28, 21, 29, 22, 30, 23, 31]


def test_block_and_scales_follow_the_paired_order_exactly() -> None:
    rng = np.random.default_rng(0)
    block = jnp.asarray(rng.integers(-128, 128, (3, 256, 128)), jnp.int8)  # every int8 value
    scales = jnp.asarray(rng.lognormal(-5.0, 2.0, (16, 256)), jnp.float32)
    order = _order(256)
    paired = jax.jit(int8_rows.to_bfloat16_paired)(block)
    assert paired.dtype == jnp.bfloat16
    expected = np.asarray(block.astype(jnp.bfloat16))[:, order]
    np.testing.assert_array_equal(np.asarray(paired), expected)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(int8_rows.pair_lanes)(scales)), np.asarray(scales)[:, order]
    )
