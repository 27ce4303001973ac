"""The host's page pool (`page_pool`): reference counts, cached prefixes and the order in
which free pages are taken (least recently freed first, a sequence's last page before its
first)."""

from __future__ import annotations

import pytest

import pallas_flash as pf
from pallas_flash_llama.page_pool import PagePool, page_keys


def test_keys_name_the_whole_prefix() -> None:
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], page_size=4)
    assert len(a) == 2, "only full pages have keys"
    assert page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    b = page_keys([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert b[1] != a[1], "the same page after another prefix has another key"
    assert page_keys([5, 6, 7, 8], 4, parent=a[0]) == a[1:]


def test_a_cached_page_is_shared_and_stays_until_needed() -> None:
    pool = PagePool(4)
    first = pool.take(2)
    keys = page_keys(range(8), 4)
    for page, key in zip(first, keys, strict=True):
        pool.cache(page, key)
    assert pool.match(keys) == first and pool.free == 2, "held twice, taken from no one"
    pool.release(first)
    pool.release(first)
    assert pool.free == 4 and pool.cached == 2
    assert pool.take(2) == [2, 3], "never-used pages go first"
    assert pool.match(keys) == first, "the cached prefix is still there"
    pool.release(first)
    assert pool.take(1) == [first[1]], "a sequence's last page goes before its first"
    assert pool.match(keys) == [first[0]] and pool.cached == 1
    with pytest.raises(pf.InvalidInputError, match="count: expected at most 0 pages"):
        pool.take(1)


def test_without_caching_no_key_is_kept() -> None:
    pool = PagePool(2, caching=False)
    (page,) = pool.take(1)
    pool.cache(page, page_keys(range(4), 4)[0])
    assert pool.cached == 0 and pool.match(page_keys(range(4), 4)) == []
