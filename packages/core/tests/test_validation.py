"""Tests of the validation helpers: their results and their error messages.

Every error message has the form ``"<argument>: expected <what>, got <what it got>"``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import validation
from pallas_flash.validation import HEADS_MAJOR, SEQ_MAJOR, AttentionDims, Layout


def _zeros(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


# --- Layout --------------------------------------------------------------------------------


def test_layout_describe_names_the_axes_in_order():
    assert HEADS_MAJOR.describe("q_heads", "q_len") == "[batch, q_heads, q_len, head_dim]"
    assert SEQ_MAJOR.describe("q_heads", "q_len") == "[batch, q_len, q_heads, head_dim]"
    assert SEQ_MAJOR.describe("kv_heads", "kv_len") == "[batch, kv_len, kv_heads, head_dim]"
    assert (HEADS_MAJOR.heads_axis, HEADS_MAJOR.seq_axis) == (1, 2)
    assert Layout(heads_axis=2, seq_axis=1).describe("h", "s") == "[batch, s, h, head_dim]"


# --- check_qkv -----------------------------------------------------------------------------


def test_check_qkv_returns_the_sizes():
    dims = validation.check_qkv(_zeros(2, 6, 3, 8), _zeros(2, 2, 5, 8), _zeros(2, 2, 5, 8))

    assert dims == AttentionDims(
        batch=2, q_heads=6, q_len=3, kv_heads=2, kv_len=5, head_dim=8, v_head_dim=8
    )


def test_check_qkv_takes_a_value_head_dim_of_its_own():
    dims = validation.check_qkv(_zeros(1, 4, 3, 192), _zeros(1, 2, 5, 192), _zeros(1, 2, 5, 128))

    assert (dims.head_dim, dims.v_head_dim) == (192, 128)


def test_check_qkv_reads_the_sizes_of_the_seq_major_layout():
    dims = validation.check_qkv(
        _zeros(2, 3, 6, 8), _zeros(2, 5, 2, 8), _zeros(2, 5, 2, 8), layout=SEQ_MAJOR
    )

    assert dims == AttentionDims(
        batch=2, q_heads=6, q_len=3, kv_heads=2, kv_len=5, head_dim=8, v_head_dim=8
    )


Q, KV = _zeros(2, 4, 3, 8), _zeros(2, 2, 5, 8)


@pytest.mark.parametrize(
    ("q", "k", "v", "name", "got"),
    [
        (Q[0], KV, KV, "q", "got shape (4, 3, 8)"),
        (Q, KV[..., None], KV, "k", "got shape (2, 2, 5, 8, 1)"),
        (Q, KV, KV[0], "v", "got shape (2, 5, 8)"),
        (Q[:, :, :0], KV, KV, "q", "every size >= 1, got shape (2, 4, 0, 8)"),
        (Q, KV, KV[:, :, :4], "v", "shape of k but head_dim, (2, 2, 5, 8), got shape (2, 2, 4, 8)"),
        (Q, KV[:1], KV[:1], "k", "batch 2 (from q), got shape (1, 2, 5, 8)"),
        (Q, KV[..., :4], KV[..., :4], "k", "head_dim 8 (from q), got shape (2, 2, 5, 4)"),
        (Q, _zeros(2, 3, 5, 8), _zeros(2, 3, 5, 8), "k", "got 3 kv heads for 4 query heads"),
        (
            Q.astype(jnp.int32),
            KV,
            KV,
            "q",
            "floating dtype (bfloat16, float16, float32), got dtype int32",
        ),
        (Q, KV.astype(jnp.bfloat16), KV, "k", "the dtype of q, float32, got dtype bfloat16"),
        (Q, KV, KV.astype(jnp.float16), "v", "got dtype float16"),
    ],
)
def test_check_qkv_errors_name_the_argument_and_what_it_got(q, k, v, name, got, raises_invalid):
    with raises_invalid(name, got):
        validation.check_qkv(q, k, v)


def test_check_qkv_rank_error_describes_the_layout(raises_invalid):
    with raises_invalid("q", "rank 4 [batch, q_heads, q_len, head_dim], got shape (4, 3, 8)"):
        validation.check_qkv(Q[0], KV, KV)
    with raises_invalid("key", "rank 4 [batch, kv_len, kv_heads, head_dim], got shape (2, 5, 8)"):
        validation.check_qkv(
            _zeros(2, 3, 4, 8), KV[0], KV, names=("query", "key", "value"), layout=SEQ_MAJOR
        )


# --- check_segment_ids ---------------------------------------------------------------------

DIMS = AttentionDims(batch=2, q_heads=4, q_len=3, kv_heads=2, kv_len=5, head_dim=8, v_head_dim=8)


def test_check_segment_ids_returns_int32_ids():
    ids = pf.SegmentIds(q=np.ones((2, 3), np.uint8), kv=jnp.full((2, 5), 7, jnp.int16))

    checked = validation.check_segment_ids(ids, DIMS)

    assert isinstance(checked, pf.SegmentIds)
    assert checked.q.dtype == jnp.int32 and checked.kv.dtype == jnp.int32
    np.testing.assert_array_equal(checked.q, np.ones((2, 3)))
    np.testing.assert_array_equal(checked.kv, np.full((2, 5), 7))


@pytest.mark.parametrize(
    ("ids", "name", "got"),
    [
        ((np.zeros((2, 3), int), np.zeros((2, 5), int)), "segment_ids", "got tuple"),
        (pf.SegmentIds(np.zeros((2, 4), int), np.zeros((2, 5), int)), "segment_ids.q", "(2, 4)"),
        (pf.SegmentIds(np.zeros((2, 3), int), np.zeros((5,), int)), "segment_ids.kv", "(5,)"),
        (pf.SegmentIds(np.zeros((2, 3)), np.zeros((2, 5), int)), "segment_ids.q", "float"),
        (pf.SegmentIds(np.zeros((2, 3), int), np.zeros((2, 5), bool)), "segment_ids.kv", "bool"),
    ],
)
def test_check_segment_ids_errors(ids, name, got, raises_invalid):
    with raises_invalid(name, got):
        validation.check_segment_ids(ids, DIMS)


@pytest.mark.parametrize(
    ("sinks", "got"),
    [(np.zeros(3), "shape (3,)"), (np.zeros((1, 4)), "shape (1, 4)"), (np.zeros(4, int), "int")],
)
def test_check_sinks_errors(sinks, got, raises_invalid):
    with raises_invalid("sinks", got):
        validation.check_sinks(sinks, DIMS)


def test_check_sinks_takes_one_float_per_query_head():
    np.testing.assert_array_equal(validation.check_sinks(np.arange(4.0), DIMS), np.arange(4.0))


# --- check_window --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("window", "causal", "expected"),
    [
        (None, False, None),
        (None, True, None),
        (3, False, (3, 3)),
        (3, True, (3, 0)),
        (0, False, (0, 0)),
        ((1, 2), False, (1, 2)),
        ([1, 2], False, (1, 2)),
        ((1, 2), True, (1, 0)),
        (np.int64(4), False, (4, 4)),
        ((np.int32(0), 5), False, (0, 5)),
    ],
)
def test_check_window_normalises_to_left_right(window, causal, expected):
    result = validation.check_window(window, causal=causal)

    assert result == expected
    assert result is None or all(type(x) is int for x in result)


@pytest.mark.parametrize(
    ("window", "name", "got"),
    [
        (-1, "sliding_window", "a non-negative int, got -1"),
        (1.5, "sliding_window", "got 1.5"),
        (True, "sliding_window", "got True"),
        ("2", "sliding_window", "got '2'"),
        ((1,), "sliding_window", "an int w or a pair (left, right), got (1,)"),
        ((1, 2, 3), "sliding_window", "got (1, 2, 3)"),
        ((-1, 2), "sliding_window[0]", "got -1"),
        ((1, None), "sliding_window[1]", "got None"),
    ],
)
def test_check_window_errors(window, name, got, raises_invalid):
    with raises_invalid(name, got):
        validation.check_window(window, causal=False)


def test_check_window_uses_the_given_argument_name(raises_invalid):
    with raises_invalid("local_window_size", "got -2"):
        validation.check_window(-2, causal=True, name="local_window_size")


# --- check_sm_scale, check_softcap, check_causal -------------------------------------------


@pytest.mark.parametrize("head_dim", [1, 8, 64, 128])
def test_check_sm_scale_defaults_to_one_over_sqrt_head_dim(head_dim):
    assert validation.check_sm_scale(None, head_dim) == pytest.approx(1 / math.sqrt(head_dim))


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0.5, 0.5), (2, 2.0), (np.float32(0.25), 0.25), (np.array(0.125), 0.125)],
)
def test_check_sm_scale_returns_a_python_float(value, expected):
    result = validation.check_sm_scale(value, 8)

    assert result == expected
    assert type(result) is float


@pytest.mark.parametrize(
    ("value", "got"),
    [
        (float("nan"), "a finite number, got nan"),
        (float("inf"), "got inf"),
        ("big", "a real number, got 'big'"),
        ("0.5", "a real number, got '0.5'"),
        (True, "got True"),
        ([1.0], "got [1.0]"),
    ],
)
def test_check_sm_scale_errors(value, got, raises_invalid):
    with raises_invalid("sm_scale", got):
        validation.check_sm_scale(value, 8)
    with raises_invalid("scale", got):
        validation.check_sm_scale(value, 8, name="scale")


@pytest.mark.parametrize(("value", "expected"), [(None, None), (30, 30.0), (0.5, 0.5)])
def test_check_softcap_accepts_none_or_a_positive_number(value, expected):
    result = validation.check_softcap(value)

    assert result == expected
    assert result is None or type(result) is float


@pytest.mark.parametrize(
    ("value", "got"),
    [
        (0, "a number > 0, got 0"),
        (-1.0, "a number > 0, got -1.0"),
        (float("inf"), "a finite number, got inf"),
        (float("nan"), "a finite number, got nan"),
        (False, "got False"),
        ("big", "a real number, got 'big'"),
        (1j, "a real number, got 1j"),
    ],
)
def test_check_softcap_errors(value, got, raises_invalid):
    with raises_invalid("softcap", got):
        validation.check_softcap(value)


def test_check_softcap_rejects_a_traced_value(raises_invalid):
    @jax.jit
    def traced(x):
        return validation.check_softcap(x)

    with raises_invalid("softcap", "a Python float known at trace time, got"):
        traced(1.0)


@pytest.mark.parametrize("value", [True, False, np.True_, np.bool_(False)])
def test_check_causal_accepts_bools(value):
    result = validation.check_causal(value)

    assert result is bool(value)


@pytest.mark.parametrize(("value", "got"), [(1, "got 1"), ("yes", "got 'yes'"), (None, "got None")])
def test_check_causal_errors(value, got, raises_invalid):
    with raises_invalid("causal", f"a bool, {got}"):
        validation.check_causal(value)
    with raises_invalid("is_causal", got):
        validation.check_causal(value, name="is_causal")
