"""Parity of ``pf.dot_product_attention`` (jax.nn layout and semantics) with the reference.

Layout ``[batch, seq, heads, head_dim]``; causal and window masks are aligned to the first
key (``q_offset = 0``), as in ``jax.nn.dot_product_attention``.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close, assert_gradient_close

BATCH, Q_LEN, KV_LEN, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 40, 72, 4, 2, 64
Q_LENGTHS = np.array([40, 17], np.int32)
KV_LENGTHS = np.array([50, 72], np.int32)


def _lengths_mask() -> np.ndarray:
    """``[batch, 1, q_len, kv_len]``: valid query rows see valid keys."""
    q_valid = np.arange(Q_LEN)[None, :] < Q_LENGTHS[:, None]
    kv_valid = np.arange(KV_LEN)[None, :] < KV_LENGTHS[:, None]
    return (q_valid[:, :, None] & kv_valid[:, None, :])[:, None]


def _sequence_major_qkv(dtype: str):
    """q ``[BATCH, Q_LEN, Q_HEADS, HEAD_DIM]``, k and v ``[BATCH, KV_LEN, KV_HEADS, HEAD_DIM]``."""
    return tuple(
        inputs.normal(seed, (BATCH, length, heads, HEAD_DIM), dtype)
        for seed, length, heads in (
            (0, Q_LEN, Q_HEADS),
            (1, KV_LEN, KV_HEADS),
            (2, KV_LEN, KV_HEADS),
        )
    )


_BIAS = inputs.normal(5, (BATCH, Q_HEADS, Q_LEN, KV_LEN))
_BIAS_BROADCAST = inputs.normal(6, (1, 1, Q_LEN, KV_LEN))
_MASK = np.random.default_rng(7).random((BATCH, 1, Q_LEN, KV_LEN)) < 0.8

ARGUMENTS = {
    # name: (pf.dot_product_attention kwargs, reference kwargs, required capabilities)
    "plain": ({}, {}, ()),
    "scale": ({"scale": 0.2}, {"sm_scale": 0.2}, ()),
    "is-causal-top-left": ({"is_causal": True}, {"causal": True}, ("causal",)),
    "window": ({"local_window_size": (6, 2)}, {"window": (6, 2)}, ("sliding_window",)),
    "bias": ({"bias": _BIAS}, {"bias": np.asarray(_BIAS)}, ("bias",)),
    "bias-broadcast": ({"bias": _BIAS_BROADCAST}, {"bias": np.asarray(_BIAS_BROADCAST)}, ("bias",)),
    "mask": ({"mask": _MASK}, {"mask": _MASK}, ("mask",)),
    "seq-lengths": (
        {"query_seq_lengths": Q_LENGTHS, "key_value_seq_lengths": KV_LENGTHS},
        {"mask": _lengths_mask()},
        ("segment_ids",),
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param(value[:2], id=name, marks=pytest.mark.requires("attention", "gqa", *value[2]))
        for name, value in ARGUMENTS.items()
    ],
)
def test_dot_product_attention(backend, arguments, dtype: str) -> None:
    kwargs, reference_kwargs = arguments
    q, k, v = _sequence_major_qkv(dtype)
    out = pf.dot_product_attention(q, k, v, implementation=backend.name, **kwargs)
    heads_major = [np.swapaxes(np.asarray(x, np.float64), 1, 2) for x in (q, k, v)]
    reference_kwargs = {"sm_scale": 1 / math.sqrt(HEAD_DIM), **reference_kwargs}
    expected = np.swapaxes(reference.attention(*heads_major, **reference_kwargs), 1, 2)
    assert_close(out, expected, FORWARD_TOLERANCE[dtype])


@pytest.mark.requires("attention")
def test_unbatched_inputs(backend) -> None:
    q, k, v = (inputs.normal(seed, (24, 2, HEAD_DIM)) for seed in range(3))
    out = pf.dot_product_attention(q, k, v, implementation=backend.name)
    heads_major = [np.swapaxes(np.asarray(x, np.float64), 0, 1)[None] for x in (q, k, v)]
    expected = reference.attention(*heads_major, sm_scale=1 / math.sqrt(HEAD_DIM))
    assert_close(out, np.swapaxes(expected[0], 0, 1), FORWARD_TOLERANCE["float32"])


def _bias_with_hidden_keys() -> np.ndarray:
    """``[1, q_heads, q_len, kv_len]`` float32: a normal bias with ``-inf`` at a fifth of the
    pairs and across all of query row 3 of head 0 (a row that sees no key)."""
    bias = np.asarray(inputs.normal(8, (1, Q_HEADS, Q_LEN, KV_LEN)), np.float32)
    hidden = np.random.default_rng(9).random(bias.shape) < 0.2
    hidden[0, 0, 3] = True
    return np.where(hidden, -np.inf, bias).astype(np.float32)


BIAS_GRADIENT_CASES = {
    # name: (pf.dot_product_attention kwargs, reference kwargs, bias, required capabilities)
    "full": ({}, {}, _BIAS, ()),
    "broadcast-causal": ({"is_causal": True}, {"causal": True}, _BIAS_BROADCAST, ("causal",)),
    "heads-hidden-keys-window": (
        {"local_window_size": (20, 4)},
        {"window": (20, 4)},
        _bias_with_hidden_keys(),
        ("sliding_window",),
    ),
    "with-mask": ({"mask": _MASK}, {"mask": _MASK}, _BIAS_BROADCAST, ("mask",)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("differentiate_bias", [True, False], ids=["dbias", "constant-bias"])
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(value, id=name, marks=pytest.mark.requires("gqa", "grad", "bias", *value[3]))
        for name, value in BIAS_GRADIENT_CASES.items()
    ],
)
def test_bias_gradients(backend, case, differentiate_bias: bool, dtype: str) -> None:
    """dq, dk, dv and (when it is differentiated) the bias's gradient, summed over the axes it
    broadcasts, against the reference; a bias that is not differentiated is a constant."""
    kwargs, reference_kwargs, bias, _ = case
    q, k, v = _sequence_major_qkv(dtype)
    d_out = inputs.normal(3, q.shape, dtype)

    def attention(q, k, v, bias):
        return pf.dot_product_attention(q, k, v, bias=bias, implementation=backend.name, **kwargs)

    @jax.jit
    def gradients(q, k, v, bias, d_out):
        if differentiate_bias:
            _, vjp = jax.vjp(attention, q, k, v, bias)
        else:
            _, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, bias), q, k, v)
        return vjp(d_out)

    grads = gradients(q, k, v, bias, d_out)
    heads_major = [np.swapaxes(np.asarray(x, np.float64), 1, 2) for x in (q, k, v, d_out)]
    options = {"sm_scale": 1 / math.sqrt(HEAD_DIM), "bias": bias, **reference_kwargs}
    expected = [np.swapaxes(g, 1, 2) for g in reference.attention_vjp(*heads_major, **options)]
    if differentiate_bias:
        expected.append(reference.bias_vjp(*heads_major, **options))
    for name, actual, wanted in zip(("dq", "dk", "dv", "dbias"), grads, expected, strict=False):
        assert actual.shape == wanted.shape, f"{name}: shape {actual.shape} != {wanted.shape}"
        assert_gradient_close(actual, wanted, dtype, name=name)
    assert len(grads) == len(expected)
