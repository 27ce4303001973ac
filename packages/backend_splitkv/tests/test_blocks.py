"""The decode tiling: validation and its fit to a cache."""

from __future__ import annotations

import pytest

from pallas_flash_splitkv import DecodeBlocks


def test_defaults_and_fit() -> None:
    assert DecodeBlocks() == DecodeBlocks(2048, 1)
    assert DecodeBlocks().for_cache(131072) == (2048, 1, 64)
    assert DecodeBlocks().for_cache(1000) == (1000, 1, 1)
    # At most one split per block; the last split may hold fewer blocks.
    assert DecodeBlocks(128, 8).for_cache(512) == (128, 4, 1)
    assert DecodeBlocks(128, 3).for_cache(1000) == (128, 3, 3)


@pytest.mark.parametrize("kwargs", [{"block_kv": 0}, {"splits": -1}, {"splits": 1.5}])
def test_invalid_values_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="DecodeBlocks"):
        DecodeBlocks(**kwargs)


def test_a_block_shorter_than_the_cache_must_be_a_multiple_of_128() -> None:
    with pytest.raises(ValueError, match="block_kv=100 is shorter than the cache"):
        DecodeBlocks(block_kv=100).for_cache(1000)
