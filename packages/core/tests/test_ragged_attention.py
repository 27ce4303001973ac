"""``pf.ragged_attention``: what core validates, writes into the cache and hands a backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash.ragged_batch import token_places

TOKENS, Q_HEADS, KV_HEADS, HEAD_DIM = 6, 4, 2, 8
NUM_PAGES, PAGE_SIZE = 6, 4
TABLE = np.array([[4, 1], [0, 5], [2, 3]], np.int32)  # 3 sequences of up to 8 positions
STARTS = np.array([0, 1, 1, 5], np.int32)  # 1 decode token, an empty slot, a 4-token chunk
LENGTHS = np.array([3, 2, 7], np.int32)


@pytest.fixture
def toy(make_backend, install):
    backend = make_backend("toy")
    install(backend)
    return backend


def _arrays(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((TOKENS, Q_HEADS, HEAD_DIM)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((TOKENS, KV_HEADS, HEAD_DIM)), dtype) for _ in "kv")
    pool = (NUM_PAGES, KV_HEADS, PAGE_SIZE, HEAD_DIM)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal(pool), dtype) for _ in "kv")
    return q, k, v, k_pages, v_pages


def _call(*arrays, table=TABLE, starts=STARTS, lengths=LENGTHS, **options):
    return pf.ragged_attention(*arrays, table, starts, lengths, **options)


def test_token_places_of_a_mixed_batch():
    places = token_places(jnp.asarray(STARTS), jnp.asarray(LENGTHS), TOKENS)
    assert places.sequence.tolist()[:5] == [0, 2, 2, 2, 2]
    assert places.position.tolist() == [2, 3, 4, 5, 6, 0]
    assert places.valid.tolist() == [True] * 5 + [False]


def test_new_tokens_are_written_at_their_positions_and_nothing_else(toy):
    q, k, v, k_pages, v_pages = _arrays()
    out, cache = _call(q, k, v, k_pages, v_pages)
    expected_k, expected_v = np.array(k_pages), np.array(v_pages)
    # token 0: sequence 0, position 2 (page 4, row 2); tokens 1-4: sequence 2, positions 3-6
    for token, (page, row) in enumerate([(4, 2), (2, 3), (3, 0), (3, 1), (3, 2)]):
        expected_k[page, :, row], expected_v[page, :, row] = k[token], v[token]
    np.testing.assert_array_equal(cache.k, expected_k)
    np.testing.assert_array_equal(cache.v, expected_v)
    (call,) = toy.calls
    np.testing.assert_array_equal(call["cache"].k, expected_k)  # the backend reads the write
    assert call["spec"] == pf.RaggedSpec(sm_scale=1 / np.sqrt(HEAD_DIM))
    assert call["query_starts"].dtype == call["kv_lengths"].dtype == jnp.int32
    np.testing.assert_array_equal(out, q + 1)


def test_an_int8_cache_gets_the_new_tokens_quantized(toy):
    q, k, v, k_pages, v_pages = _arrays()
    (k8, k_scales), (v8, v_scales) = pf.quantize_int8(k_pages), pf.quantize_int8(v_pages)
    _, cache = _call(q, k, v, k8, v8, k_scales=k_scales, v_scales=v_scales)
    held = pf.dequantize_int8(cache.k, cache.k_scales, jnp.float32)
    np.testing.assert_allclose(held[4, :, 2], k[0], atol=float(jnp.abs(k[0]).max()) / 127)
    assert cache.k.dtype == jnp.int8 and cache.k_scales.dtype == jnp.float32


def test_traced_layout_under_jit_with_the_cache_donated(toy):
    q, k, v, k_pages, v_pages = _arrays()
    expected = _call(q, k, v, k_pages, v_pages)[1].k

    @jax.jit
    def step(k_pages, v_pages, table, starts, lengths):
        return _call(q, k, v, k_pages, v_pages, table=table, starts=starts, lengths=lengths)

    step = jax.jit(step, donate_argnums=(0, 1))
    _, cache = step(k_pages, v_pages, TABLE, STARTS, LENGTHS)
    np.testing.assert_array_equal(cache.k, expected)


def test_a_traced_page_out_of_range_is_written_nowhere(toy):
    q, k, v, k_pages, v_pages = _arrays()
    table = TABLE.copy()
    table[2, 1] = 99  # sequence 2's positions 4-6
    _, cache = jax.jit(lambda table: _call(q, k, v, k_pages, v_pages, table=table))(table)
    changed = np.argwhere((np.asarray(cache.k) != np.asarray(k_pages)).any((1, 3)))
    assert changed.tolist() == [[2, 3], [4, 2]]  # positions 3 and 2: the rest had no page


def test_features_reach_the_backend_selection(make_backend, install):
    install(make_backend("plain", {"ragged"}))
    arrays = _arrays()
    with pytest.raises(pf.UnsupportedFeatureError, match="softcap"):
        _call(*arrays, softcap=3.0, backend="plain")
    with pytest.raises(pf.UnsupportedFeatureError, match="sliding_window"):
        _call(*arrays, sliding_window=4, backend="plain")
    with pytest.raises(pf.UnsupportedFeatureError, match="gqa"):
        _call(*arrays, backend="plain")


def test_the_spec_carries_the_options(toy):
    sinks = jnp.zeros((Q_HEADS,))
    _call(*_arrays(), sm_scale=0.5, softcap=3.0, sliding_window=4, sinks=sinks)
    (call,) = toy.calls
    assert call["spec"] == pf.RaggedSpec(sm_scale=0.5, softcap=3.0, window=4)
    assert call["sinks"] is not None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(starts=np.array([1, 1, 1, 5])), r"^query_starts: expected non-decreasing values"),
        (dict(starts=np.array([0, 3, 1, 5])), r"^query_starts: expected non-decreasing values"),
        (dict(starts=np.array([0, 1, 1, 7])), r"at most the 6 tokens"),
        (dict(starts=np.array([0, 1, 5])), r"^query_starts: expected shape \(4,\) \[seqs \+ 1\]"),
        (dict(lengths=np.array([3, 2, 3])), r"^kv_lengths: expected at least each sequence's new"),
        (dict(lengths=np.array([3, 2, 9])), r"^kv_lengths: expected values in \[0, 8"),
        (dict(lengths=np.array([3, 2])), r"^kv_lengths: expected shape \(3,\)"),
        (dict(table=np.array([[4, 1], [0, 5], [2, 6]])), r"^page_table: expected indices in"),
        (dict(table=TABLE[:, :, None]), r"^page_table: expected rank 2"),
    ],
)
def test_bad_layouts_name_the_argument(toy, change, message):
    with pytest.raises(pf.InvalidInputError, match=message):
        _call(*_arrays(), **change)
    assert toy.calls == []


def test_bad_arrays_name_the_argument(toy):
    q, k, v, k_pages, v_pages = _arrays()
    with pytest.raises(pf.InvalidInputError, match=r"^k: expected shape \(6, 2, 8\)"):
        _call(q, k[:, :1], v, k_pages, v_pages)
    with pytest.raises(pf.InvalidInputError, match=r"^v: expected q's dtype float32"):
        _call(q, k, v.astype(jnp.bfloat16), k_pages, v_pages)
    with pytest.raises(pf.InvalidInputError, match=r"^q: expected rank 3 \[tokens, q_heads"):
        _call(q[None], k, v, k_pages, v_pages)
    with pytest.raises(pf.InvalidInputError, match=r"^k_cache: expected .*head_dim 8"):
        _call(q, k, v, k_pages[..., :4], v_pages[..., :4])
    with pytest.raises(pf.InvalidInputError, match=r"^k_scales: expected float32"):
        _call(q, k, v, k_pages.astype(jnp.int8), v_pages.astype(jnp.int8))
    with pytest.raises(pf.InvalidInputError, match=r"^sliding_window: expected a non-negative"):
        _call(q, k, v, k_pages, v_pages, sliding_window=-1)
    assert toy.calls == []


def test_a_backend_that_writes_the_new_tokens_itself_gets_them_unwritten(make_backend, install):
    """``Backend.ragged_attention_and_write``: a backend that overrides it gets the new keys
    and values beside the cache as the caller gave it (core writes nothing), and the API
    returns its output and cache; the base class writes, then calls ``ragged_attention``."""
    q, k, v, k_pages, v_pages = _arrays()
    base = make_backend("writes-itself")

    class WritesItself(type(base)):
        def ragged_attention_and_write(self, q, k, v, cache, query_starts, kv_lengths, spec,
                                       *, sinks=None):  # fmt: skip
            self.calls.append(dict(k=k, v=v, cache=cache))
            return q - 1, cache._replace(k=cache.k + 1)

    backend = WritesItself(base.name, base.capabilities, base.platforms, base.priority, base.fn)
    install(backend)
    out, cache = _call(q, k, v, k_pages, v_pages, backend="writes-itself")
    (call,) = backend.calls
    np.testing.assert_array_equal(call["cache"].k, k_pages)  # unwritten
    np.testing.assert_array_equal(call["k"], k)
    np.testing.assert_array_equal(out, q - 1)
    np.testing.assert_array_equal(cache.k, k_pages + 1)
