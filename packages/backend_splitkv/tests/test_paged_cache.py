"""`PagedKVCache`: page allocation, in-place append (bfloat16 and int8), release, decode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close
from pallas_flash_splitkv import PagedKVCache

BATCH, KV_HEADS, PAGE_SIZE, HEAD_DIM = 3, 2, 4, 64


def _empty(dtype=jnp.float32, num_pages: int = 8, pages_per_sequence: int = 3) -> PagedKVCache:
    return PagedKVCache.empty(
        BATCH, pages_per_sequence, num_pages, KV_HEADS, PAGE_SIZE, HEAD_DIM, dtype
    )


def _tokens(seed: int) -> tuple[jax.Array, jax.Array]:
    return (inputs.normal(seed + s, (BATCH, KV_HEADS, HEAD_DIM)) for s in (0, 1))


def test_append_allocates_a_page_per_page_size_tokens_and_writes_in_place():
    cache = _empty()
    history = []
    active = np.array([True, True, False])
    for step in range(5):  # sequence 2 stays empty
        k_new, v_new = _tokens(10 * step)
        history.append(k_new)
        old = cache.k
        cache = cache.append(k_new, v_new, active)
        assert old.is_deleted(), "the old pool is donated: updated in place"
    np.testing.assert_array_equal(cache.lengths, [5, 5, 0])
    assert int(cache.num_free.sum()) == 8 - 4  # two pages for each of 5 tokens, none for the idle
    table = np.asarray(cache.page_table)
    assert (table[2] == -1).all() and (table[:, 2] == -1).all()
    assert len(set(table[:2, :2].ravel())) == 4, "every page is held by one sequence"
    for position, k_new in enumerate(history):  # each row landed where the table says
        for b in (0, 1):
            page = table[b, position // PAGE_SIZE]
            np.testing.assert_array_equal(cache.k[page, :, position % PAGE_SIZE], k_new[b])


def test_release_returns_pages_that_the_next_sequence_reuses():
    cache = _empty(num_pages=4, pages_per_sequence=2)
    for step in range(PAGE_SIZE + 1):  # two pages each
        cache = cache.append(*_tokens(step), np.array([True, True, False]))
    assert int(cache.num_free.sum()) == 0
    with pytest.raises(pf.InvalidInputError, match="num_free: expected 1 free pages"):
        cache.append(*_tokens(9), np.array([False, False, True]))
    held = set(np.asarray(cache.page_table)[0])
    cache = cache.release(np.array([True, False, False]))
    np.testing.assert_array_equal(cache.lengths, [0, PAGE_SIZE + 1, 0])
    assert int(cache.num_free.sum()) == 2 and (np.asarray(cache.page_table)[0] == -1).all()
    cache = cache.append(*_tokens(20), np.array([False, False, True]))
    assert np.asarray(cache.page_table)[2, 0] in held


def test_a_full_sequence_raises_and_under_jit_waits():
    cache = _empty(num_pages=8, pages_per_sequence=1)
    for step in range(PAGE_SIZE):
        cache = cache.append(*_tokens(step))
    with pytest.raises(pf.InvalidInputError, match="lengths: expected room for one more token"):
        cache.append(*_tokens(99))
    cache = jax.jit(lambda c, k, v: c.append(k, v))(cache, *_tokens(99))
    np.testing.assert_array_equal(cache.lengths, [PAGE_SIZE] * BATCH)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8], ids=["bfloat16", "int8"])
def test_decode_matches_the_contiguous_cache_it_holds(dtype):
    """Appends of ragged sequences, then decode through the page table against the xla
    backend on the contiguous K/V (int8: quantized on append, so compared with tolerance)."""
    cache = _empty(dtype, num_pages=9)
    lengths = np.array([7, 1, 10])
    ks, vs = [], []
    for step in range(10):
        k_new, v_new = _tokens(step)
        ks.append(k_new), vs.append(v_new)
        cache = cache.append(k_new, v_new, step < lengths)
    np.testing.assert_array_equal(cache.lengths, lengths)
    assert (cache.k_scales is not None) == (dtype == jnp.int8)
    q = inputs.normal(50, (BATCH, 4, HEAD_DIM), "bfloat16")
    k, v = (jnp.stack(x, axis=2).astype(jnp.bfloat16) for x in (ks, vs))  # [batch, heads, 10, d]
    expected = pf.decode(q, k, v, lengths, backend="xla")
    out = cache.decode(q, backend="splitkv")
    assert_close(out, np.asarray(expected, np.float64), 2 * FORWARD_TOLERANCE["bfloat16"])
    assert_close(cache.decode(q, backend="xla"), np.asarray(out, np.float64), 1e-2)
