"""Tests of the float64 NumPy reference against hand-written expectations.

Visibility rules are checked against literal visible/hidden tables; values against a plain
dense softmax over the visible keys only; gradients against central finite differences and
against ``jax.grad`` of an independent float64 JAX implementation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_flash_conformance import reference

# Masked rows and huge logits must be handled without any inf or NaN arithmetic.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def _normal(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _qkv(
    batch: int = 2,
    q_heads: int = 2,
    kv_heads: int = 2,
    q_len: int = 3,
    kv_len: int = 4,
    dim: int = 3,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        _normal(1, batch, q_heads, q_len, dim),
        _normal(2, batch, kv_heads, kv_len, dim),
        _normal(3, batch, kv_heads, kv_len, dim),
    )


def _dense(q, k, v, sm_scale, *, softcap=None, bias=0.0):
    """Softmax attention over every key, one kv head per query head."""
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) * sm_scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    scores = scores + bias
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True) @ v


def _over_visible_keys(q, k, v, visible, sm_scale):
    """Row by row: dense attention over only the keys ``visible`` marks; zeros if none."""
    visible = np.broadcast_to(np.asarray(visible, dtype=bool), q.shape[:3] + k.shape[2:3])
    out = np.zeros(q.shape)
    for b, h, i in np.ndindex(*q.shape[:3]):
        keys = np.flatnonzero(visible[b, h, i])
        if keys.size:
            row = _dense(
                q[b, h, i][None, None, None],
                k[b, h, keys][None, None],
                v[b, h, keys][None, None],
                sm_scale,
            )
            out[b, h, i] = row[0, 0, 0]
    return out


def test_matches_softmax_written_out_by_hand():
    q = np.array([[1.0, 0.0], [0.0, 1.0]])
    k = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    v = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    # Scores times 0.5: row 0 -> [0.5, 0, 0.5], row 1 -> [0, 0.5, 0.5].
    e = math.exp(0.5)
    expected = np.array(
        [
            [(e * 1 + 3 + e * 5) / (2 * e + 1), (e * 2 + 4 + e * 6) / (2 * e + 1)],
            [(1 + e * 3 + e * 5) / (2 * e + 1), (2 + e * 4 + e * 6) / (2 * e + 1)],
        ]
    )
    out = reference.attention(q[None, None], k[None, None], v[None, None], sm_scale=0.5)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out[0, 0], expected, rtol=1e-14)


@pytest.mark.parametrize(
    ("q_offset", "causal", "window", "expected"),
    [
        pytest.param(0, True, None, ["1000", "1100", "1110"], id="causal-top-left"),
        pytest.param(2, True, None, ["11100", "11110", "11111"], id="causal-bottom-right"),
        pytest.param(0, False, (1, 1), ["11000", "11100", "01110"], id="window"),
        pytest.param(2, False, (2, 0), ["11100", "01110", "00111"], id="window-offset"),
        pytest.param(1, True, (1, 5), ["11000", "01100", "00110"], id="window-causal"),
        pytest.param(-1, True, None, ["00", "10", "11"], id="causal-q-longer-than-kv"),
        pytest.param(-1, False, (0, 0), ["00", "10", "01"], id="window-q-longer-than-kv"),
    ],
)
def test_position_visibility(q_offset, causal, window, expected):
    visible = np.array([[c == "1" for c in row] for row in expected])
    q, k, v = _qkv(q_len=visible.shape[0], kv_len=visible.shape[1])
    out = reference.attention(
        q, k, v, sm_scale=0.7, causal=causal, q_offset=q_offset, window=window
    )
    np.testing.assert_allclose(out, _over_visible_keys(q, k, v, visible, 0.7), rtol=1e-12)


def test_segment_ids_restrict_to_equal_ids():
    q, k, v = _qkv(q_len=3, kv_len=4)
    q_ids = np.array([[0, 0, 1], [3, 1, 2]])
    kv_ids = np.array([[0, 1, 1, 2], [1, 1, 2, 2]])
    visible = np.array(
        [
            [[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 0]],
            [[0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1]],
        ],
        dtype=bool,
    )[:, None]
    out = reference.attention(q, k, v, sm_scale=0.7, segment_ids=(q_ids, kv_ids))
    np.testing.assert_allclose(out, _over_visible_keys(q, k, v, visible, 0.7), rtol=1e-12)
    assert np.all(out[1, :, 0] == 0.0)


@pytest.mark.parametrize("shape", [(3, 4), (2, 1, 3, 4), (2, 2, 3, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_mask_restricts_to_true_entries(shape, causal):
    q, k, v = _qkv(q_len=3, kv_len=4)
    mask = np.random.default_rng(4).random(shape) < 0.6
    visible = (
        mask & np.array([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=bool) if causal else mask
    )
    out = reference.attention(q, k, v, sm_scale=0.7, mask=mask, causal=causal, q_offset=1)
    np.testing.assert_allclose(out, _over_visible_keys(q, k, v, visible, 0.7), rtol=1e-12)


def test_bias_is_added_to_scores():
    q, k, v = _qkv()
    bias = _normal(5, 1, 2, 3, 4)
    out = reference.attention(q, k, v, sm_scale=0.7, bias=bias)
    np.testing.assert_allclose(out, _dense(q, k, v, 0.7, bias=bias), rtol=1e-12)
    assert not np.allclose(out, reference.attention(q, k, v, sm_scale=0.7))
    # A bias constant along each row leaves the softmax unchanged.
    row_bias = _normal(6, 3, 1)
    np.testing.assert_allclose(
        reference.attention(q, k, v, sm_scale=0.7, bias=row_bias),
        reference.attention(q, k, v, sm_scale=0.7),
        rtol=1e-12,
    )


def test_softcap_applies_before_bias():
    q, k, v = _qkv()
    q = 4 * q
    bias = _normal(5, 3, 4)
    out = reference.attention(q, k, v, sm_scale=1.0, softcap=2.0, bias=bias)
    np.testing.assert_allclose(out, _dense(q, k, v, 1.0, softcap=2.0, bias=bias), rtol=1e-12)
    assert not np.allclose(out, _dense(q, k, v, 1.0, bias=bias))


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_query_head_reads_kv_head_of_its_group(kv_heads):
    q, k, v = _qkv(q_heads=4, kv_heads=kv_heads)
    out = reference.attention(q, k, v, sm_scale=0.7, causal=True)
    for h in range(4):
        g = h // (4 // kv_heads)
        single = reference.attention(
            q[:, h : h + 1], k[:, g : g + 1], v[:, g : g + 1], sm_scale=0.7, causal=True
        )
        np.testing.assert_allclose(out[:, h : h + 1], single, rtol=1e-14)


def test_head_counts_must_divide():
    q, k, v = _qkv(q_heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="multiple"):
        reference.attention(q, k, v, sm_scale=1.0)


def test_low_precision_and_jax_inputs_are_computed_in_float64():
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in _qkv())
    expected = reference.attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), sm_scale=0.7
    )
    out = reference.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), sm_scale=0.7)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, expected)


def test_fully_masked_rows_give_zeros_and_no_gradient():
    q, k, v = _qkv(q_heads=4, kv_heads=2)
    d_out = _normal(7, *q.shape)
    mask = np.ones((2, 4, 3, 4), dtype=bool)
    mask[0, 1, 2] = False
    mask[1, :, 0] = False
    out = reference.attention(q, k, v, sm_scale=0.7, mask=mask, softcap=3.0)
    dq, dk, dv = reference.attention_vjp(q, k, v, d_out, sm_scale=0.7, mask=mask, softcap=3.0)
    assert np.all(out[0, 1, 2] == 0.0) and np.all(out[1, :, 0] == 0.0)
    assert np.all(dq[0, 1, 2] == 0.0) and np.all(dq[1, :, 0] == 0.0)
    assert not np.any(out[0, 0] == 0.0)
    # The masked rows' d_out must not reach dk and dv.
    d_out_cleared = d_out.copy()
    d_out_cleared[~mask.any(axis=-1)] = 0.0
    _, dk_cleared, dv_cleared = reference.attention_vjp(
        q, k, v, d_out_cleared, sm_scale=0.7, mask=mask, softcap=3.0
    )
    np.testing.assert_array_equal(dk, dk_cleared)
    np.testing.assert_array_equal(dv, dv_cleared)

    nothing = np.zeros_like(mask)
    grads = reference.attention_vjp(q, k, v, d_out, sm_scale=0.7, mask=nothing)
    assert np.all(reference.attention(q, k, v, sm_scale=0.7, mask=nothing) == 0.0)
    assert all(np.all(g == 0.0) for g in grads)


@pytest.mark.parametrize("softcap", [None, 5e3])
def test_large_logits_stay_finite(softcap):
    q, k, v = _qkv(dim=4)
    q, k = 60 * q, 60 * k
    d_out = _normal(7, *q.shape)
    scores = np.einsum("bhqd,bhkd->bhqk", q, k)
    assert np.abs(scores).max() > 1e4
    out = reference.attention(q, k, v, sm_scale=1.0, softcap=softcap, causal=True, q_offset=1)
    grads = reference.attention_vjp(
        q, k, v, d_out, sm_scale=1.0, softcap=softcap, causal=True, q_offset=1
    )
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
    # With gaps this wide the softmax is one-hot on the best visible key.
    scores = np.where(np.tri(3, 4, 1, dtype=bool), scores, -np.inf)
    best = np.take_along_axis(v, scores.argmax(axis=-1)[..., None], axis=2)
    np.testing.assert_allclose(out, best, rtol=1e-12)


GRADIENT_CASES = {
    "plain": ({}, {}),
    "causal-bottom-right": ({}, {"causal": True, "q_offset": 1}),
    "softcap": ({}, {"softcap": 1.5}),
    "gqa-causal": ({"q_heads": 4}, {"causal": True, "q_offset": 1, "softcap": 2.0}),
    "mqa-window": ({"q_heads": 3, "kv_heads": 1}, {"window": (1, 0), "q_offset": 1}),
    "segment-ids": (
        {},
        {"segment_ids": (np.array([[0, 0, 1], [2, 1, 1]]), np.array([[0, 1, 1, 1], [1, 1, 2, 2]]))},
    ),
    "bias": ({}, {"bias": _normal(5, 2, 1, 3, 4)}),
    "mask-softcap-gqa": ({"q_heads": 4}, {"mask": _normal(6, 2, 4, 3, 4) > 0, "softcap": 1.0}),
}


@pytest.mark.parametrize(("shape", "options"), GRADIENT_CASES.values(), ids=GRADIENT_CASES.keys())
def test_vjp_matches_finite_differences(shape, options):
    q, k, v = (2 * x for x in _qkv(**shape))
    d_out = _normal(7, *q.shape)
    grads = reference.attention_vjp(q, k, v, d_out, sm_scale=0.8, **options)

    eps = 1e-6
    for x, grad in zip((q, k, v), grads, strict=True):
        assert grad.shape == x.shape
        numeric = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            saved = x[index]
            losses = []
            for step in (eps, -eps):
                x[index] = saved + step
                losses.append(np.sum(reference.attention(q, k, v, sm_scale=0.8, **options) * d_out))
            x[index] = saved
            numeric[index] = (losses[0] - losses[1]) / (2 * eps)
        assert np.abs(numeric).max() > 1e-3
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


def _jax_attention(q, k, v, *, visible, sm_scale, softcap, bias):
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * sm_scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(visible, scores + bias, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


@pytest.mark.parametrize(
    ("kv_heads", "causal", "softcap"), [(2, False, None), (1, True, 2.0), (2, True, None)]
)
def test_vjp_matches_jax_grad(kv_heads, causal, softcap):
    q, k, v = _qkv(q_heads=4, kv_heads=kv_heads, q_len=5, kv_len=7, dim=8)
    d_out = _normal(7, *q.shape)
    bias = _normal(8, 5, 7)
    visible = np.tri(5, 7, 2, dtype=bool) if causal else np.ones((5, 7), dtype=bool)
    options = {"sm_scale": 0.4, "softcap": softcap, "bias": bias}

    with jax.enable_x64(True):

        def loss(q, k, v, bias):
            scores = _jax_attention(q, k, v, visible=visible, **{**options, "bias": bias})
            return jnp.sum(scores * d_out)

        expected = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
        assert all(g.dtype == jnp.float64 for g in expected)
    grads = reference.attention_vjp(q, k, v, d_out, causal=causal, q_offset=2, **options)
    dbias = reference.bias_vjp(q, k, v, d_out, causal=causal, q_offset=2, **options)
    assert dbias.shape == bias.shape
    for grad, want in zip((*grads, dbias), expected, strict=True):
        np.testing.assert_allclose(grad, np.asarray(want), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("softcap", [None, 1.0])
def test_decode_matches_attention_on_sliced_cache(softcap):
    lengths = np.array([0, 1, 3, 5])
    q = _normal(1, 4, 4, 8)
    k_cache, v_cache = _normal(2, 4, 2, 5, 8), _normal(3, 4, 2, 5, 8)
    for b, length in enumerate(lengths):  # positions past the length must be ignored
        k_cache[b, :, length:] = 1e3
        v_cache[b, :, length:] = 1e3
    out = reference.decode(q, k_cache, v_cache, lengths, sm_scale=0.3, softcap=softcap)
    assert out.shape == (4, 4, 8)
    assert np.all(out[0] == 0.0)
    for b, length in enumerate(lengths[1:], start=1):
        expected = reference.attention(
            q[b : b + 1, :, None],
            k_cache[b : b + 1, :, :length],
            v_cache[b : b + 1, :, :length],
            sm_scale=0.3,
            softcap=softcap,
        )
        np.testing.assert_allclose(out[b], expected[0, :, 0], rtol=1e-14)


@pytest.mark.parametrize("lengths", [[-1, 2], [2, 6]])
def test_decode_rejects_lengths_outside_cache(lengths):
    cache = np.zeros((2, 1, 5, 4))
    with pytest.raises(ValueError, match="lengths"):
        reference.decode(np.zeros((2, 1, 4)), cache, cache, lengths, sm_scale=1.0)
