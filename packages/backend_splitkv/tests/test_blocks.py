"""The decode tiling: validation and its fit to a cache."""

from __future__ import annotations

import pytest

from pallas_flash_splitkv import DecodeBlocks

BF16_8_HEADS = 8 * 128 * 2 * 2  # K and V bytes per position: 8 kv heads, head_dim 128


def test_defaults_and_fit() -> None:
    assert DecodeBlocks() == DecodeBlocks(None, 1)
    # Automatic: the blocks of all kv heads near 1 MiB, a multiple of 128, at least 128.
    assert DecodeBlocks().for_cache(131072, BF16_8_HEADS) == (256, 1, 512)
    assert DecodeBlocks().for_cache(131072, BF16_8_HEADS // 2) == (512, 1, 256)  # int8
    assert DecodeBlocks().for_cache(131072, 32 * BF16_8_HEADS) == (128, 1, 1024)
    assert DecodeBlocks().for_cache(100, BF16_8_HEADS) == (100, 1, 1)
    assert DecodeBlocks(2048).for_cache(1000, BF16_8_HEADS) == (1000, 1, 1)
    # At most one split per block; the last split may hold fewer blocks.
    assert DecodeBlocks(128, 8).for_cache(512, BF16_8_HEADS) == (128, 4, 1)
    assert DecodeBlocks(128, 3).for_cache(1000, BF16_8_HEADS) == (128, 3, 3)
    assert DecodeBlocks(splits=2).for_pages(5) == (2, 3)


@pytest.mark.parametrize("kwargs", [{"block_kv": 0}, {"splits": -1}, {"splits": 1.5}])
def test_invalid_values_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="DecodeBlocks"):
        DecodeBlocks(**kwargs)


def test_a_block_shorter_than_the_cache_must_be_a_multiple_of_128() -> None:
    with pytest.raises(ValueError, match="block_kv=100 is shorter than the cache"):
        DecodeBlocks(block_kv=100).for_cache(1000, BF16_8_HEADS)
