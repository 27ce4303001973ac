"""How the decode kernel tiles the cache: the kv block size and the number of splits."""

from __future__ import annotations

import dataclasses
import math

LANES = 128
"""Lanes of a vreg: a block shorter than the cache must be a multiple of this."""

STEP_BYTES = 1 << 20
"""K and V bytes one grid step reads when the block size is chosen automatically: 1 MiB is
about 1.3 us of HBM time on v5e (819 GB/s), several times the fixed cost of a step, and
2 MiB double-buffered in VMEM."""


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """The decode kernel's tiling of one device's part of the cache.

    The cache's sequence axis is cut into blocks of ``block_kv`` positions (of every kv head
    at once), and the blocks into ``splits`` contiguous groups. Each split is an independent
    (parallel) grid axis that yields a partial output and log-sum-exp, merged exactly
    afterwards. A paged cache is read ``pages_per_step`` pages per block (several: in one
    split).

    Why one split by default: a TPU v5e chip has one TensorCore, which runs the grid's steps
    one after another, so splits add no parallelism there, only the merge. They pay off on
    chips with two TensorCores per chip (v4, v5p: megacore) when ``batch`` is smaller than
    the number of cores; across chips, the sequence is split over the mesh instead.

    Attributes:
      block_kv: cache positions per grid step of a contiguous cache (clamped to the cache
        length; a shorter block must be a multiple of 128). None: the multiple of 128 whose
        K and V blocks of all kv heads come nearest `STEP_BYTES` (at least 128), e.g. 256
        positions at 8 kv heads of head_dim 128 in bfloat16, 512 in int8. Small blocks
        waste less of a short sequence's last block; large ones amortise a step's fixed cost.
      splits: independent groups of blocks per sequence (of a contiguous cache).
      pages_per_step: pages of a paged cache per grid step. None: as many as come nearest
        `STEP_BYTES` (at least 1), when a page is a multiple of 128 positions; else 1.
    """

    block_kv: int | None = None
    splits: int = 1
    pages_per_step: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_kv", "splits", "pages_per_step"):
            value = getattr(self, name)
            if value is None and name != "splits":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecodeBlocks.{name} must be a positive int, got {value!r}")

    def for_cache(self, max_len: int, bytes_per_position: int) -> tuple[int, int, int]:
        """``(block_kv, splits, blocks_per_split)`` for a contiguous cache of ``max_len``
        positions whose K and V take ``bytes_per_position`` (all kv heads): the block clamped
        to the cache, at most one split per block.

        Raises:
          ValueError: a block shorter than the cache is not a multiple of 128.
        """
        block_kv = self.block_kv
        if block_kv is None:
            block_kv = max(LANES, STEP_BYTES // bytes_per_position // LANES * LANES)
        elif block_kv < max_len and block_kv % LANES:
            raise ValueError(
                f"DecodeBlocks.block_kv={block_kv} is shorter than the cache ({max_len}) "
                f"and so must be a multiple of {LANES}"
            )
        block_kv = min(block_kv, max_len)
        return (block_kv, *self.for_pages(math.ceil(max_len / block_kv)))

    def for_pages(self, num_blocks: int) -> tuple[int, int]:
        """``(splits, blocks_per_split)`` for a sequence of ``num_blocks`` blocks (pages)."""
        splits = min(self.splits, num_blocks)
        return splits, math.ceil(num_blocks / splits)

    def for_paged(self, pages_per_sequence: int, page_size: int, bytes_per_page: int) -> int:
        """Pages per grid step of a paged cache whose pages (K and V, all kv heads) take
        ``bytes_per_page``: at most ``pages_per_sequence``.

        Raises:
          ValueError: several pages per step of pages that are not a multiple of 128
            positions (a step's pages are copied side by side into one block).
        """
        per_step = self.pages_per_step
        if per_step is None:
            aligned = page_size % LANES == 0
            per_step = max(1, STEP_BYTES // bytes_per_page) if aligned else 1
        elif per_step > 1 and page_size % LANES:
            raise ValueError(
                f"DecodeBlocks.pages_per_step={per_step} needs pages of a multiple of "
                f"{LANES} positions, got page_size={page_size}"
            )
        return min(per_step, pages_per_sequence)
