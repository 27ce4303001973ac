"""Tests of what ``pf.attention``, ``pf.dot_product_attention`` and ``pf.decode`` hand backends.

A recording toy backend (conftest.py) shows the normalised specs, arrays and segment ids each
entry point passes, and backends that lack one capability show which features a call uses.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import api
from pallas_flash.validation import AttentionDims

CAPS = pf.Capability
EVERY = frozenset(CAPS)


def _normal(seed: int, *shape: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _qkv(batch=2, q_heads=4, kv_heads=2, q_len=3, kv_len=5, dim=8):
    return (
        _normal(0, batch, q_heads, q_len, dim),
        _normal(1, batch, kv_heads, kv_len, dim),
        _normal(2, batch, kv_heads, kv_len, dim),
    )


@pytest.fixture
def toy(make_backend, install):
    """A recording backend with every capability, installed alone."""
    backend = make_backend("toy")
    install(backend)
    return backend


# --- pf.attention: what the backend sees ---------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, dict(causal=False, window=None, softcap=None)),
        ({"causal": True}, dict(causal=True, window=None, softcap=None)),
        ({"sliding_window": 3}, dict(causal=False, window=(3, 3), softcap=None)),
        ({"sliding_window": (1, 2)}, dict(causal=False, window=(1, 2), softcap=None)),
        ({"sliding_window": 3, "causal": True}, dict(causal=True, window=(3, 0), softcap=None)),
        ({"sliding_window": (1, 2), "causal": True}, dict(causal=True, window=(1, 0))),
        ({"softcap": 30}, dict(causal=False, window=None, softcap=30.0)),
    ],
)
def test_attention_passes_a_normalised_spec(toy, kwargs, expected):
    q, k, v = _qkv(q_len=3, kv_len=5, dim=8)

    pf.attention(q, k, v, **kwargs)

    spec = toy.calls[-1]["spec"]
    assert spec == pf.AttentionSpec(
        sm_scale=1 / math.sqrt(8), q_offset=2, **{"softcap": None, **expected}
    )
    assert isinstance(spec.sm_scale, float)
    assert spec.softcap is None or isinstance(spec.softcap, float)


@pytest.mark.parametrize(("q_len", "kv_len", "q_offset"), [(3, 5, 2), (4, 4, 0), (5, 2, -3)])
def test_attention_aligns_queries_to_the_end_of_the_keys(toy, q_len, kv_len, q_offset):
    q, k, v = _qkv(q_len=q_len, kv_len=kv_len)

    pf.attention(q, k, v, causal=True)

    assert toy.calls[-1]["spec"].q_offset == q_offset


def test_attention_passes_explicit_sm_scale_and_the_arrays_unchanged(toy):
    q, k, v = _qkv()

    out = pf.attention(np.asarray(q), np.asarray(k), np.asarray(v), sm_scale=0.5)

    call = toy.calls[-1]
    assert call["spec"].sm_scale == 0.5
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert isinstance(call[name], jax.Array)
        np.testing.assert_array_equal(call[name], x)
    assert call["segment_ids"] is None and call["bias"] is None and call["mask"] is None
    expected = toy.fn(q, k, v, call["spec"])
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_attention_passes_segment_ids_as_int32(toy):
    q, k, v = _qkv(batch=2, q_len=3, kv_len=5)
    q_ids = np.array([[0, 0, 1], [2, 2, 2]], np.int8)
    kv_ids = np.array([[0, 0, 1, 1, 1], [2, 2, 2, 3, 3]], np.int64)

    pf.attention(q, k, v, segment_ids=pf.SegmentIds(q=q_ids, kv=kv_ids))

    seen = toy.calls[-1]["segment_ids"]
    assert isinstance(seen, pf.SegmentIds)
    assert seen.q.dtype == jnp.int32 and seen.kv.dtype == jnp.int32
    np.testing.assert_array_equal(seen.q, q_ids)
    np.testing.assert_array_equal(seen.kv, kv_ids)


def test_attention_passes_sinks_only_to_calls_that_use_them(toy, make_backend, install):
    q, k, v = _qkv(batch=1, q_heads=2, kv_heads=2, q_len=3, kv_len=3)
    pf.attention(q, k, v, sinks=np.array([0.5, -1.0], np.float32))
    np.testing.assert_array_equal(toy.calls[-1]["sinks"], [0.5, -1.0])

    class WithoutSinks(pf.Backend):  # a backend written before sinks: no such keyword
        name, capabilities, platforms = "old", {"attention"}, {jax.default_backend()}

        def attention(self, q, k, v, spec, *, segment_ids=None, bias=None, mask=None):
            return q

    install(WithoutSinks())
    assert pf.attention(q, k, v, backend="old") is not None
    with pytest.raises(pf.UnsupportedFeatureError, match="sinks"):
        pf.attention(q, k, v, sinks=np.zeros(2, np.float32), backend="old")


def test_invalid_input_is_reported_before_any_backend_is_looked_up(registry):
    q, k, v = _qkv()

    with pytest.raises(pf.InvalidInputError, match=r"^q: expected rank 4"):
        pf.attention(q[0], k, v)
    with pytest.raises(pf.InvalidInputError, match=r"^causal: expected a bool, got 1"):
        pf.attention(q, k, v, causal=1)
    with pytest.raises(pf.InvalidInputError, match=r"^segment_ids: expected"):
        pf.attention(q, k, v, segment_ids=(q[..., 0], k[..., 0]))


# --- pf.dot_product_attention: what the backend sees ---------------------------------------


def _bshd(batch=2, q_len=3, kv_len=5, q_heads=4, kv_heads=2, dim=8):
    """query, key, value in the [batch, seq, heads, head_dim] layout."""
    return (
        _normal(3, batch, q_len, q_heads, dim),
        _normal(4, batch, kv_len, kv_heads, dim),
        _normal(5, batch, kv_len, kv_heads, dim),
    )


def test_dot_product_attention_passes_heads_major_arrays_and_a_start_aligned_spec(toy):
    query, key, value = _bshd(q_len=3, kv_len=5, dim=8)

    out = pf.dot_product_attention(query, key, value, is_causal=True, local_window_size=2)

    call = toy.calls[-1]
    assert call["spec"] == pf.AttentionSpec(
        sm_scale=1 / math.sqrt(8), causal=True, q_offset=0, window=(2, 0)
    )
    np.testing.assert_array_equal(call["q"], jnp.swapaxes(query, 1, 2))
    np.testing.assert_array_equal(call["k"], jnp.swapaxes(key, 1, 2))
    np.testing.assert_array_equal(call["v"], jnp.swapaxes(value, 1, 2))
    expected = toy.fn(call["q"], call["k"], call["v"], call["spec"])
    assert out.shape == query.shape
    np.testing.assert_allclose(out, jnp.swapaxes(expected, 1, 2), rtol=1e-6)


def test_dot_product_attention_passes_scale_and_window_pair(toy):
    query, key, value = _bshd()

    pf.dot_product_attention(query, key, value, scale=0.25, local_window_size=(1, 3))

    assert toy.calls[-1]["spec"] == pf.AttentionSpec(
        sm_scale=0.25, causal=False, q_offset=0, window=(1, 3)
    )


def test_dot_product_attention_passes_bias_and_mask_as_given(toy):
    query, key, value = _bshd(batch=2, q_len=3, kv_len=5, q_heads=4)
    bias = _normal(6, 1, 4, 3, 1)
    mask = np.random.default_rng(7).random((2, 1, 3, 5)) > 0.5

    pf.dot_product_attention(query, key, value, bias=bias, mask=mask)

    call = toy.calls[-1]
    assert call["bias"].shape == (1, 4, 3, 1)
    np.testing.assert_array_equal(call["bias"], bias)
    assert call["mask"].shape == (2, 1, 3, 5) and call["mask"].dtype == jnp.bool_
    np.testing.assert_array_equal(call["mask"], mask)
    assert call["segment_ids"] is None


def _visible_pairs(segment_ids: pf.SegmentIds) -> np.ndarray:
    """[batch, q_len, kv_len]: where the query's segment id equals the key's."""
    return np.asarray(segment_ids.q)[:, :, None] == np.asarray(segment_ids.kv)[:, None, :]


@pytest.mark.parametrize(
    ("q_lengths", "kv_lengths"),
    [([2, 3], [4, 1]), ([0, 3], None), (None, [5, 2]), ([1, 2], [0, 5])],
)
def test_dot_product_attention_encodes_sequence_lengths_as_segment_ids(toy, q_lengths, kv_lengths):
    query, key, value = _bshd(batch=2, q_len=3, kv_len=5)

    pf.dot_product_attention(
        query,
        key,
        value,
        query_seq_lengths=None if q_lengths is None else jnp.array(q_lengths),
        key_value_seq_lengths=None if kv_lengths is None else jnp.array(kv_lengths),
    )

    seen = toy.calls[-1]["segment_ids"]
    assert seen.q.shape == (2, 3) and seen.kv.shape == (2, 5)
    assert seen.q.dtype == jnp.int32 and seen.kv.dtype == jnp.int32
    q_valid = np.arange(3)[None, :] < np.array(q_lengths or [3, 3])[:, None]
    kv_valid = np.arange(5)[None, :] < np.array(kv_lengths or [5, 5])[:, None]
    # A valid query sees every valid key; padded queries and padded keys match nothing.
    np.testing.assert_array_equal(_visible_pairs(seen), q_valid[:, :, None] & kv_valid[:, None, :])


def test_dot_product_attention_unbatched_inputs_come_back_unbatched(toy):
    query, key, value = (x[0] for x in _bshd(batch=1, q_len=3, kv_len=5, q_heads=4))
    bias = _normal(8, 4, 3, 5)

    out = pf.dot_product_attention(query, key, value, bias=bias)

    call = toy.calls[-1]
    assert call["q"].shape == (1, 4, 3, 8)
    assert call["k"].shape == (1, 2, 5, 8)
    assert call["bias"].shape == (1, 4, 3, 5)
    assert out.shape == query.shape == (3, 4, 8)
    expected = toy.fn(call["q"], call["k"], call["v"], call["spec"])
    np.testing.assert_allclose(out, jnp.swapaxes(expected, 1, 2)[0], rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"bias": np.zeros((1, 2, 4, 3, 5))}, r"^bias: expected .*got shape \(1, 2, 4, 3, 5\)"),
        ({"bias": np.zeros((2, 4, 3, 4))}, r"^bias: expected .*broadcastable to \(2, 4, 3, 5\)"),
        ({"mask": np.ones((2, 2, 3, 5), bool)}, r"^mask: expected .*got shape \(2, 2, 3, 5\)"),
        ({"bias": np.zeros((1, 1, 3, 5), np.int32)}, r"^bias: expected a floating dtype"),
        ({"mask": np.ones((1, 1, 3, 5), np.float32)}, r"^mask: expected dtype bool.*float32"),
        ({"query_seq_lengths": jnp.array([1, 2, 3])}, r"^query_seq_lengths: expected .*\(2,\)"),
        ({"key_value_seq_lengths": jnp.array([1.0, 2.0])}, r"^key_value_seq_lengths: expected"),
        ({"is_causal": "yes"}, r"^is_causal: expected a bool"),
        ({"scale": "big"}, r"^scale: expected a real number"),
        ({"local_window_size": -1}, r"^local_window_size: expected a non-negative int"),
    ],
)
def test_dot_product_attention_rejects_malformed_arguments(toy, kwargs, pattern):
    query, key, value = _bshd(batch=2, q_len=3, kv_len=5, q_heads=4)

    with pytest.raises(pf.InvalidInputError, match=pattern):
        pf.dot_product_attention(query, key, value, **kwargs)

    assert toy.calls == []


def test_dot_product_attention_names_its_own_arguments_in_shape_errors(toy):
    query, key, value = _bshd()

    with pytest.raises(pf.InvalidInputError, match=r"^key: expected rank 4 \[batch, kv_len"):
        pf.dot_product_attention(query, key[0, 0], value)


# --- pf.decode: what the backend sees ------------------------------------------------------


def test_decode_passes_decode_spec_int32_lengths_and_mesh(toy):
    q = _normal(9, 2, 4, 8)
    k_cache, v_cache = _normal(10, 2, 2, 6, 8), _normal(11, 2, 2, 6, 8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))

    out = pf.decode(q, k_cache, v_cache, np.array([3, 6], np.int16), softcap=10, mesh=mesh)

    call = toy.calls[-1]
    assert call["spec"] == pf.DecodeSpec(sm_scale=1 / math.sqrt(8), softcap=10.0)
    assert call["lengths"].dtype == jnp.int32
    np.testing.assert_array_equal(call["lengths"], [3, 6])
    assert call["mesh"] is mesh
    assert isinstance(call["cache"], pf.DecodeCache)
    np.testing.assert_array_equal(call["cache"].k, k_cache)
    np.testing.assert_array_equal(call["cache"].v, v_cache)
    assert call["cache"][2:] == (None, None, None)  # no page table, no scales
    np.testing.assert_array_equal(out, q + 1)  # the toy decode returns q + 1


def test_decode_passes_a_paged_int8_cache_with_an_int32_table(toy):
    q, pages = _normal(9, 2, 4, 8), _normal(10, 3, 2, 4, 8)
    k, k_scales = pf.quantize_int8(pages)
    table = np.array([[2, 0], [1, 2]], np.int64)

    pf.decode(q, k, k, [5, 8], page_table=table, k_scales=k_scales, v_scales=k_scales)

    cache = toy.calls[-1]["cache"]
    assert (cache.paged, cache.quantized, cache.max_len) == (True, True, 8)
    assert cache.page_table.dtype == jnp.int32
    np.testing.assert_array_equal(cache.page_table, table)
    np.testing.assert_array_equal(cache.k_scales, k_scales)


def test_decode_passes_explicit_sm_scale_and_no_mesh_by_default(toy):
    q, cache = _normal(12, 1, 2, 4), _normal(13, 1, 2, 3, 4)

    pf.decode(q, cache, cache, [2], sm_scale=0.125)

    call = toy.calls[-1]
    assert call["spec"] == pf.DecodeSpec(sm_scale=0.125, softcap=None)
    assert call["mesh"] is None


def test_decode_rejects_concrete_lengths_out_of_range(toy):
    q, cache = _normal(12, 2, 2, 4), _normal(13, 2, 2, 6, 4)

    with pytest.raises(
        pf.InvalidInputError, match=r"^lengths: expected values in \[0, max_len=6\], got .*7"
    ):
        pf.decode(q, cache, cache, jnp.array([3, 7]))

    assert toy.calls == []


def test_decode_accepts_traced_lengths_under_jit(toy):
    q, cache = _normal(12, 2, 2, 4), _normal(13, 2, 2, 6, 4)

    @jax.jit
    def step(lengths):
        return pf.decode(q, cache, cache, lengths)

    out = step(jnp.array([3, 7]))  # out of range, but not known at trace time

    assert isinstance(toy.calls[-1]["lengths"], jax.core.Tracer)
    np.testing.assert_array_equal(out, q + 1)


# --- the features of a call ----------------------------------------------------------------


_ONE_DEVICE_MESH = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))


def _attention_call(kv_heads=2, v_head_dim=None, **kwargs):
    def call(backend):
        q, k, v = _qkv(batch=1, q_heads=2, kv_heads=kv_heads, q_len=3, kv_len=3)
        if v_head_dim is not None:
            v = v[..., :v_head_dim]
        return pf.attention(q, k, v, backend=backend, **kwargs)

    return call


def _dpa_call(**kwargs):
    def call(backend):
        query, key, value = _bshd(batch=1, q_len=3, kv_len=3, q_heads=2, kv_heads=2)
        return pf.dot_product_attention(query, key, value, implementation=backend, **kwargs)

    return call


_IDS = pf.SegmentIds(q=jnp.zeros((1, 3), jnp.int32), kv=jnp.zeros((1, 3), jnp.int32))
FEATURE_CALLS = {
    "plain attention": (None, _attention_call()),
    "plain dot_product_attention": (None, _dpa_call()),
    "causal": (CAPS.CAUSAL, _attention_call(causal=True)),
    "is_causal": (CAPS.CAUSAL, _dpa_call(is_causal=True)),
    "gqa": (CAPS.GQA, _attention_call(kv_heads=1)),
    "segment_ids": (CAPS.SEGMENT_IDS, _attention_call(segment_ids=_IDS)),
    "query_seq_lengths": (CAPS.SEGMENT_IDS, _dpa_call(query_seq_lengths=jnp.array([2]))),
    "key_value_seq_lengths": (CAPS.SEGMENT_IDS, _dpa_call(key_value_seq_lengths=jnp.array([2]))),
    "sliding_window": (CAPS.SLIDING_WINDOW, _attention_call(sliding_window=1)),
    "sliding_window 0": (CAPS.SLIDING_WINDOW, _attention_call(sliding_window=0)),
    "local_window_size": (CAPS.SLIDING_WINDOW, _dpa_call(local_window_size=(1, 0))),
    "softcap": (CAPS.SOFTCAP, _attention_call(softcap=5.0)),
    "bias": (CAPS.BIAS, _dpa_call(bias=jnp.zeros((1, 1, 3, 3)))),
    "mask": (CAPS.MASK, _dpa_call(mask=jnp.ones((1, 2, 3, 3), bool))),
    "sinks": (CAPS.SINKS, _attention_call(sinks=jnp.zeros((2,)))),
    "value_head_dim": (CAPS.VALUE_HEAD_DIM, _attention_call(v_head_dim=4)),
    "mesh": (CAPS.CONTEXT_PARALLEL, _attention_call(mesh=_ONE_DEVICE_MESH)),
}
CALL_FEATURES = [CAPS.CAUSAL, CAPS.GQA, CAPS.SEGMENT_IDS, CAPS.SLIDING_WINDOW, CAPS.SOFTCAP]
CALL_FEATURES += [CAPS.BIAS, CAPS.MASK, CAPS.SINKS, CAPS.VALUE_HEAD_DIM, CAPS.CONTEXT_PARALLEL]


@pytest.mark.parametrize("call_name", list(FEATURE_CALLS))
def test_a_feature_is_required_exactly_when_the_call_uses_it(make_backend, install, call_name):
    used, call = FEATURE_CALLS[call_name]
    zeros = lambda q, *args, **kwargs: jnp.zeros_like(q)  # noqa: E731
    install(*(make_backend(f"no_{f}", EVERY - {f}, fn=zeros) for f in CALL_FEATURES))

    for lacking in CALL_FEATURES:
        if lacking == used:
            with pytest.raises(pf.UnsupportedFeatureError) as info:
                call(f"no_{lacking}")
            assert f"backend 'no_{lacking}' (from the backend argument)" in str(info.value)
            assert f"does not support {lacking};" in str(info.value)
        else:
            assert call(f"no_{lacking}").shape[0] == 1


@pytest.mark.parametrize("call_name", list(FEATURE_CALLS))
def test_every_call_needs_the_attention_capability(make_backend, install, call_name):
    _, call = FEATURE_CALLS[call_name]
    install(make_backend("decode_only", EVERY - {CAPS.ATTENTION}))

    with pytest.raises(pf.UnsupportedFeatureError, match="does not support attention"):
        call("decode_only")


def test_attention_features_directly():
    dims = AttentionDims(
        batch=1, q_heads=4, q_len=3, kv_heads=4, kv_len=5, head_dim=8, v_head_dim=8
    )
    spec = pf.AttentionSpec(sm_scale=1.0, q_offset=2)
    features = api.attention_features

    assert features(spec, dims) == {CAPS.ATTENTION}
    assert features(dataclasses.replace(spec, causal=True), dims) == {CAPS.ATTENTION, CAPS.CAUSAL}
    assert features(spec, dims._replace(kv_heads=1)) == {CAPS.ATTENTION, CAPS.GQA}
    assert features(dataclasses.replace(spec, window=(0, 0)), dims) == {
        CAPS.ATTENTION,
        CAPS.SLIDING_WINDOW,
    }
    assert features(dataclasses.replace(spec, softcap=1.0), dims) == {CAPS.ATTENTION, CAPS.SOFTCAP}
    assert features(spec, dims, segment_ids=_IDS) == {CAPS.ATTENTION, CAPS.SEGMENT_IDS}
    assert features(spec, dims, bias=0.0) == {CAPS.ATTENTION, CAPS.BIAS}
    assert features(spec, dims, mask=False) == {CAPS.ATTENTION, CAPS.MASK}
    assert features(spec, dims, sinks=0.0) == {CAPS.ATTENTION, CAPS.SINKS}
    assert features(spec, dims, context={}) == {CAPS.ATTENTION, CAPS.CONTEXT_PARALLEL}
    assert features(spec, dims._replace(v_head_dim=4)) == {CAPS.ATTENTION, CAPS.VALUE_HEAD_DIM}
    everything = features(
        pf.AttentionSpec(sm_scale=1.0, causal=True, window=(1, 0), softcap=2.0),
        dims._replace(kv_heads=2, v_head_dim=4),
        segment_ids=_IDS,
        bias=0.0,
        mask=True,
        sinks=0.0,
        context={},
    )
    decode_only = {
        CAPS.DECODE, CAPS.RAGGED, CAPS.PAGED_CACHE, CAPS.INT8_CACHE, CAPS.PACKED_CACHE,
        CAPS.MULTI_DEVICE,
    }  # fmt: skip
    assert everything == EVERY - decode_only - {CAPS.GRAD}


@pytest.mark.parametrize(
    ("lacking", "kwargs", "q_heads"),
    [
        (CAPS.DECODE, {}, 2),
        (CAPS.GQA, {}, 4),
        (CAPS.SOFTCAP, {"softcap": 3.0}, 2),
        (CAPS.PAGED_CACHE, {"page_table": [[0]]}, 2),  # the cache as one page of 3 positions
    ],
)
def test_decode_requires_a_feature_exactly_when_used(
    make_backend, install, lacking, kwargs, q_heads
):
    cache = _normal(15, 1, 2, 3, 4)
    install(make_backend("lacking", EVERY - {lacking}))

    with pytest.raises(pf.UnsupportedFeatureError, match=f"does not support {lacking};"):
        pf.decode(_normal(14, 1, q_heads, 4), cache, cache, [2], backend="lacking", **kwargs)
    if lacking != CAPS.DECODE:  # the same backend serves a call without the feature
        q = _normal(14, 1, 2, 4)
        assert pf.decode(q, cache, cache, [2], backend="lacking").shape == q.shape


def test_an_int8_cache_requires_int8_cache(make_backend, install):
    q, (k, scales) = _normal(14, 1, 2, 4), pf.quantize_int8(_normal(15, 1, 2, 3, 4))
    install(make_backend("lacking", EVERY - {CAPS.INT8_CACHE}))

    with pytest.raises(pf.UnsupportedFeatureError, match="does not support int8_cache;"):
        pf.decode(q, k, k, [2], k_scales=scales, v_scales=scales, backend="lacking")


def test_plain_decode_needs_only_the_decode_capability(make_backend, install):
    q, cache = _normal(14, 1, 2, 4), _normal(15, 1, 2, 3, 4)
    install(make_backend("decode_only", {CAPS.DECODE}))

    np.testing.assert_array_equal(pf.decode(q, cache, cache, [2]), q + 1)


# --- gradients and jit ---------------------------------------------------------------------


def _loss(backend):
    return lambda q, k, v: jnp.sum(pf.attention(q, k, v, causal=True, backend=backend) ** 2)


def test_backend_without_grad_runs_forward_but_refuses_gradients(make_backend, install, dense):
    backend = make_backend("nograd", EVERY - {CAPS.GRAD}, fn=dense)
    install(backend)
    q, k, v = _qkv()

    out = pf.attention(q, k, v, causal=True, backend="nograd")
    np.testing.assert_allclose(out, backend.fn(q, k, v, backend.calls[-1]["spec"]), rtol=1e-6)

    for grad in (jax.grad(_loss("nograd")), jax.jit(jax.grad(_loss("nograd"), argnums=(1, 2)))):
        with pytest.raises(pf.UnsupportedFeatureError, match="'nograd' does not support grad"):
            grad(q, k, v)


def test_backend_with_grad_is_differentiated_directly(make_backend, install, dense):
    toy = make_backend("toy", fn=dense)
    install(toy)
    q, k, v = _qkv()
    spec = pf.AttentionSpec(sm_scale=1 / math.sqrt(q.shape[-1]), causal=True, q_offset=2)

    grads = jax.grad(_loss("toy"), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(lambda q, k, v: jnp.sum(toy.fn(q, k, v, spec) ** 2), argnums=(0, 1, 2))(
        q, k, v
    )

    for got, want in zip(grads, expected, strict=True):
        assert bool(jnp.all(jnp.isfinite(got)))
        assert float(jnp.abs(got).max()) > 0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_attention_works_under_jit(toy):
    q, k, v = _qkv()
    ids = pf.SegmentIds(q=jnp.zeros((2, 3), jnp.int32), kv=jnp.zeros((2, 5), jnp.int32))

    @jax.jit
    def run(q, k, v, ids):
        return pf.attention(q, k, v, causal=True, sliding_window=2, segment_ids=ids)

    out = run(q, k, v, ids)

    traced = toy.calls[-1]
    assert isinstance(traced["q"], jax.core.Tracer)
    assert isinstance(traced["segment_ids"].q, jax.core.Tracer)
    assert traced["spec"] == pf.AttentionSpec(
        sm_scale=1 / math.sqrt(8), causal=True, q_offset=2, window=(2, 0)
    )
    np.testing.assert_allclose(
        out,
        pf.attention(q, k, v, causal=True, sliding_window=2, segment_ids=ids),
        rtol=1e-5,
        atol=1e-6,
    )


def test_a_context_parallel_call_passes_its_layout_and_exchange(toy):
    q, k, v = _qkv(batch=1, q_heads=2, kv_heads=2, q_len=4, kv_len=4)
    pf.attention(q, k, v, mesh=_ONE_DEVICE_MESH, context_layout="zigzag",
                 context_exchange="all_gather")  # fmt: skip
    (call,) = toy.calls
    assert call["mesh"] is _ONE_DEVICE_MESH
    assert (call["context_layout"], call["context_exchange"]) == ("zigzag", "all_gather")
