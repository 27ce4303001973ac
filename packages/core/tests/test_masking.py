"""Tests of the shared score transforms against explicit loops over query and key positions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_flash.masking import apply_softcap, positional_mask
from pallas_flash.specs import AttentionSpec


def _mask(q_len: int, kv_len: int, spec: AttentionSpec) -> np.ndarray | None:
    """positional_mask over whole ``[q_len, 1]`` / ``[1, kv_len]`` position vectors."""
    result = positional_mask(jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :], spec)
    return None if result is None else np.asarray(result)


def _loop_mask(q_len: int, kv_len: int, spec: AttentionSpec) -> np.ndarray:
    """The visibility rules of AttentionSpec, one query/key pair at a time."""
    visible = np.ones((q_len, kv_len), bool)
    for i in range(q_len):
        p = i + spec.q_offset
        for j in range(kv_len):
            if spec.causal and j > p:
                visible[i, j] = False
            if spec.window is not None and not p - spec.window[0] <= j <= p + spec.window[1]:
                visible[i, j] = False
    return visible


@pytest.mark.parametrize("q_offset", [-2, 0, 3])
def test_no_positional_rule_gives_none(q_offset):
    spec = AttentionSpec(sm_scale=1.0, q_offset=q_offset, softcap=5.0)

    assert positional_mask(jnp.arange(3)[:, None], jnp.arange(4)[None, :], spec) is None


def test_causal_with_fewer_queries_than_keys_is_aligned_to_the_last_key():
    spec = AttentionSpec(sm_scale=1.0, causal=True, q_offset=3)  # q_len 2, kv_len 5

    mask = _mask(2, 5, spec)

    expected = np.array(
        [
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ],
        bool,
    )
    np.testing.assert_array_equal(mask, expected)
    np.testing.assert_array_equal(mask, _loop_mask(2, 5, spec))


def test_causal_with_more_queries_than_keys_hides_every_key_from_the_first_rows():
    spec = AttentionSpec(sm_scale=1.0, causal=True, q_offset=-2)  # q_len 5, kv_len 3

    mask = _mask(5, 3, spec)

    expected = np.array(
        [
            [0, 0, 0],
            [0, 0, 0],
            [1, 0, 0],
            [1, 1, 0],
            [1, 1, 1],
        ],
        bool,
    )
    np.testing.assert_array_equal(mask, expected)
    np.testing.assert_array_equal(mask, _loop_mask(5, 3, spec))


def test_causal_without_offset_is_lower_triangular():
    mask = _mask(4, 4, AttentionSpec(sm_scale=1.0, causal=True))

    np.testing.assert_array_equal(mask, np.tril(np.ones((4, 4), bool)))


def test_window_left_right_without_causal():
    spec = AttentionSpec(sm_scale=1.0, q_offset=1, window=(1, 2))  # q_len 4, kv_len 5

    mask = _mask(4, 5, spec)

    expected = np.array(
        [
            [1, 1, 1, 1, 0],  # position 1: keys 0..3
            [0, 1, 1, 1, 1],  # position 2: keys 1..4
            [0, 0, 1, 1, 1],  # position 3: keys 2..5
            [0, 0, 0, 1, 1],  # position 4: keys 3..6
        ],
        bool,
    )
    np.testing.assert_array_equal(mask, expected)
    np.testing.assert_array_equal(mask, _loop_mask(4, 5, spec))


def test_window_zero_sees_only_the_aligned_key():
    mask = _mask(3, 3, AttentionSpec(sm_scale=1.0, window=(0, 0)))

    np.testing.assert_array_equal(mask, np.eye(3, dtype=bool))


def test_causal_and_window_together():
    spec = AttentionSpec(sm_scale=1.0, causal=True, q_offset=2, window=(1, 0))  # q 3, kv 5

    mask = _mask(3, 5, spec)

    expected = np.array(
        [
            [0, 1, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        bool,
    )
    np.testing.assert_array_equal(mask, expected)
    np.testing.assert_array_equal(mask, _loop_mask(3, 5, spec))


def test_causal_ignores_a_right_window_that_was_not_normalised():
    spec = AttentionSpec(sm_scale=1.0, causal=True, window=(1, 3))

    np.testing.assert_array_equal(
        _mask(4, 4, spec), _mask(4, 4, AttentionSpec(sm_scale=1.0, causal=True, window=(1, 0)))
    )


def test_positional_mask_of_one_block_is_that_block_of_the_whole_mask():
    spec = AttentionSpec(sm_scale=1.0, causal=True, q_offset=3, window=(2, 0))
    whole = _mask(6, 9, spec)

    block = positional_mask(jnp.arange(2, 4)[:, None], jnp.arange(4, 8)[None, :], spec)

    assert block.shape == (2, 4)
    assert block.dtype == jnp.bool_
    np.testing.assert_array_equal(block, whole[2:4, 4:8])


def test_positional_mask_broadcasts_its_index_arrays():
    spec = AttentionSpec(sm_scale=1.0, causal=True)

    mask = positional_mask(jnp.arange(3)[None, :, None], jnp.arange(4)[None, None, :], spec)

    assert mask.shape == (1, 3, 4)
    np.testing.assert_array_equal(mask[0], _loop_mask(3, 4, spec))


def test_apply_softcap_is_softcap_tanh_of_scores_over_softcap():
    scores = jnp.array([[-1000.0, -3.0, 0.0], [0.5, 7.0, 1e6]], jnp.float32)

    capped = apply_softcap(scores, 5.0)

    np.testing.assert_allclose(capped, 5.0 * np.tanh(np.asarray(scores) / 5.0), rtol=1e-6)
    assert float(jnp.abs(capped).max()) <= 5.0
    assert capped[0, 2] == 0


def test_apply_softcap_none_is_the_identity():
    scores = jnp.array([-1e9, -2.5, 0.0, 3.0, 1e9], jnp.float32)

    np.testing.assert_array_equal(apply_softcap(scores, None), scores)


# Sizes come from a short list so that jax compiles each array operation for few shapes.
@settings(max_examples=60, deadline=None)
@given(
    q_len=st.sampled_from([1, 2, 5]),
    kv_len=st.sampled_from([1, 3, 6]),
    q_offset=st.integers(-7, 7),
    causal=st.booleans(),
    window=st.none() | st.tuples(st.integers(0, 7), st.integers(0, 7)),
)
def test_positional_mask_equals_a_double_loop(q_len, kv_len, q_offset, causal, window):
    spec = AttentionSpec(sm_scale=1.0, causal=causal, q_offset=q_offset, window=window)

    mask = _mask(q_len, kv_len, spec)

    if not causal and window is None:
        assert mask is None
    else:
        assert mask.shape == (q_len, kv_len)
        np.testing.assert_array_equal(mask, _loop_mask(q_len, kv_len, spec))
