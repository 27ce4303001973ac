"""`pf.PageAllocator`: prompts' pages, one more token's page, release; and the page writes of
`pallas_flash.cache_write` (int8 quantized with their scales)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import page_allocator
from pallas_flash.cache_write import write_kv, write_pages

PAGE = 4


def test_prompts_take_whole_pages_and_the_next_token_a_page_at_each_boundary() -> None:
    pages = pf.PageAllocator.empty(batch=3, pages_per_sequence=3, num_pages=8)
    lengths = jnp.asarray([4, 1, 9], jnp.int32)  # a boundary; inside a page; three pages
    pages, granted = page_allocator.allocate_prompts(pages, lengths, PAGE)
    np.testing.assert_array_equal(granted.sum(axis=1), [1, 1, 3])
    table = np.asarray(pages.page_table)
    assert sorted(table[table >= 0].tolist()) == list(range(5))  # lowest pages first
    assert int(pages.num_free[0]) == 3
    active = jnp.asarray([True, True, True])
    pages, page, active = page_allocator.allocate_next(pages, lengths, active, PAGE)
    np.testing.assert_array_equal(active, [True, True, True])
    table = np.asarray(pages.page_table)
    assert table[0, 1] == page[0] and table[0, 1] >= 5  # a new page for sequence 0 only
    np.testing.assert_array_equal(page[1:], [table[1, 0], table[2, 2]])
    assert int(pages.num_free[0]) == 2
    pages = page_allocator.release(pages, jnp.asarray([False, False, True]))
    assert int(pages.num_free[0]) == 5 and (np.asarray(pages.page_table)[2] == -1).all()


def test_a_full_sequence_or_an_empty_pool_gets_no_page() -> None:
    pages = pf.PageAllocator.empty(batch=2, pages_per_sequence=1, num_pages=1)
    lengths = jnp.asarray([0, 0], jnp.int32)
    pages, page, active = page_allocator.allocate_next(pages, lengths, jnp.ones(2, bool), PAGE)
    np.testing.assert_array_equal(active, [True, False])  # one page: the second waits
    np.testing.assert_array_equal(page, [0, -1])
    with pytest.raises(
        pf.InvalidInputError, match="num_free: expected 1 free pages for this append, got 0"
    ):
        page_allocator.check_free_pages(np.asarray(pages.num_free), np.array([4, 0]), PAGE,
                                        np.array([False, True]))  # fmt: skip
    full = jnp.asarray([PAGE, 0], jnp.int32)
    _, _, active = page_allocator.allocate_next(pages, full, jnp.asarray([True, False]), PAGE)
    assert not np.asarray(active).any()


def test_write_kv_writes_pages_quantized_with_their_scales() -> None:
    values = np.random.default_rng(0).standard_normal((2, 2, PAGE, 8)).astype(np.float32)
    pool = jnp.zeros((3, 2, PAGE, 8), jnp.int8)
    cache = pf.DecodeCache(pool, pool, None, jnp.zeros((3, 2, PAGE)), jnp.zeros((3, 2, PAGE)))
    pages = jnp.asarray([2, -1], jnp.int32)  # the second is written nowhere

    def write(array, x):
        return write_pages(array, x, pages)

    cache = write_kv(cache, jnp.asarray(values), jnp.asarray(-values), write)
    k = np.asarray(pf.dequantize_int8(cache.k, cache.k_scales, jnp.float32))
    np.testing.assert_allclose(k[2], values[0], atol=np.abs(values[0]).max() / 127)
    assert not k[:2].any() and not np.asarray(cache.v_scales)[:2].any()
    np.testing.assert_array_equal(cache.v[2], -np.asarray(cache.k[2]))
