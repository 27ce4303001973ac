"""How the decode kernel tiles the cache: the kv block size and the number of splits."""

from __future__ import annotations

import dataclasses
import math

LANES = 128
"""Lanes of a vreg: a block shorter than the cache must be a multiple of this."""


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """The decode kernel's tiling of one device's part of the cache.

    The cache's sequence axis is cut into blocks of ``block_kv`` positions, and the blocks
    into ``splits`` contiguous groups. Each split is an independent (parallel) grid axis that
    yields a partial output and log-sum-exp, merged exactly afterwards.

    Why one split by default: a TPU v5e chip has one TensorCore, which runs the grid's steps
    one after another, so splits add no parallelism there, only the merge. They pay off on
    chips with two TensorCores per chip (v4, v5p: megacore) when ``batch x kv_heads`` is
    smaller than the number of cores; across chips, the sequence is split over the mesh
    instead (see `sharded`).

    Attributes:
      block_kv: cache positions per grid step (clamped to the cache length; a shorter block
        must be a multiple of 128). 2048 positions are 512 KiB of K and of V at head_dim 128
        in bfloat16: the DMA of one block (about 1.3 us at 819 GB/s) dwarfs the fixed cost
        of a grid step.
      splits: independent groups of blocks per sequence and kv head.
    """

    block_kv: int = 2048
    splits: int = 1

    def __post_init__(self) -> None:
        for name in ("block_kv", "splits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecodeBlocks.{name} must be a positive int, got {value!r}")

    def for_cache(self, max_len: int) -> tuple[int, int, int]:
        """``(block_kv, splits, blocks_per_split)`` for a cache of ``max_len`` positions: the
        block clamped to the cache, at most one split per block.

        Raises:
          ValueError: a block shorter than the cache is not a multiple of 128.
        """
        if self.block_kv < max_len and self.block_kv % LANES:
            raise ValueError(
                f"DecodeBlocks.block_kv={self.block_kv} is shorter than the cache ({max_len}) "
                f"and so must be a multiple of {LANES}"
            )
        block_kv = min(self.block_kv, max_len)
        num_blocks = math.ceil(max_len / block_kv)
        splits = min(self.splits, num_blocks)
        return block_kv, splits, math.ceil(num_blocks / splits)
