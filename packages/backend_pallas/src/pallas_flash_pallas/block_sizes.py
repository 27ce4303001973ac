"""Block sizes of the forward kernel, their v5e defaults, and the VMEM-fit check."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

LANES = 128
"""Lanes of a vreg: the minor dimension of every VMEM tile."""

VMEM_CAPACITY_BYTES = 128 * 1024 * 1024
"""VMEM of one TPU v5e TensorCore."""

MIN_VMEM_LIMIT_BYTES = 32 * 1024 * 1024
"""The smallest scoped-VMEM limit the kernel asks Mosaic for (its v5e default is 16 MiB)."""


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """How the kernel tiles one call.

    A block at least as long as its sequence is clamped to the sequence length (a block equal
    to the full dimension is always legal). A shorter block must be a multiple of 128; the
    sequence is then split into ``ceil(len / block)`` blocks, the last one possibly partial.

    The defaults are the best compromise of a sweep of the static v5e schedule (B=1, H=16,
    N=4096, head_dim 128, bfloat16): 1024/1024/256 reaches about 87 % of the peak without a
    mask and 72 % with a causal one (useful flops only; see the package README).

    Attributes:
      block_q: query rows resident in VMEM while the K/V blocks stream past.
      block_kv: key/value rows per grid step.
      block_q_compute: the query block is processed in sub-blocks of this many rows, one after
        another in straight-line code; they are independent, so the compiler overlaps the
        matmuls of one with the softmax of another and keeps the MXU busy. Clamped to
        ``block_q``; a multiple of 128 (the last sub-block may be shorter).
    """

    block_q: int = 1024
    block_kv: int = 1024
    block_q_compute: int = 256

    def __post_init__(self) -> None:
        for name in ("block_q", "block_kv", "block_q_compute"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")
        if self.block_q_compute % LANES:
            raise ValueError(
                f"BlockSizes.block_q_compute must be a multiple of {LANES}, "
                f"got {self.block_q_compute}"
            )

    def clamped(self, q_len: int, kv_len: int) -> BlockSizes:
        """The sizes for one call: each block at most its sequence's length.

        Raises:
          ValueError: a block shorter than its sequence is not a multiple of 128.
        """
        for name, block, length in (
            ("block_q", self.block_q, q_len),
            ("block_kv", self.block_kv, kv_len),
        ):
            if block < length and block % LANES:
                raise ValueError(
                    f"BlockSizes.{name}={block} is shorter than the sequence ({length}) and so "
                    f"must be a multiple of {LANES}"
                )
        block_q = min(self.block_q, q_len)
        return BlockSizes(block_q, min(self.block_kv, kv_len), self.block_q_compute)


def _tile_bytes(rows: int, cols: int, dtype: np.dtype) -> int:
    """VMEM bytes of a ``[rows, cols]`` buffer, padded to whole ``(8 * packing, 128)`` tiles."""
    itemsize = np.dtype(dtype).itemsize
    sublanes = 8 * (4 // itemsize)
    return math.ceil(rows / sublanes) * sublanes * math.ceil(cols / LANES) * LANES * itemsize


def vmem_bytes(blocks: BlockSizes, head_dim: int, dtype: np.dtype, segment_ids: bool) -> int:
    """Estimated VMEM of one kernel instance.

    Counts the double-buffered pipeline blocks (q, k, v, output, log-sum-exp, segment ids),
    the scratch (running max and sum ``[block_q, 128]``, accumulator ``[block_q, head_dim]``,
    all float32; the queries' segment ids ``[block_q, 128]``) and the float32 temporaries of
    one row sub-block (scores, probabilities, mask: ``[block_q_compute, block_kv]`` each).
    """
    bq, bkv = blocks.block_q, blocks.block_kv
    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    pipelined = (
        2 * _tile_bytes(bq, head_dim, dtype)  # q and output
        + 2 * _tile_bytes(bkv, head_dim, dtype)  # k and v
        + _tile_bytes(1, bq, f32)  # log-sum-exp
    )
    scratch = 2 * _tile_bytes(bq, LANES, f32) + _tile_bytes(bq, head_dim, f32)
    if segment_ids:
        pipelined += _tile_bytes(1, bq, i32) + _tile_bytes(1, bkv, i32)
        scratch += _tile_bytes(bq, LANES, i32)
    temporaries = 3 * _tile_bytes(min(blocks.block_q_compute, bq), bkv, f32)
    return 2 * pipelined + scratch + temporaries


def vmem_limit_bytes(
    blocks: BlockSizes,
    head_dim: int,
    dtype: np.dtype,
    segment_ids: bool,
    capacity: int = VMEM_CAPACITY_BYTES,
) -> int:
    """The scoped-VMEM limit to compile with: twice the estimate, at least 32 MiB, at most the
    capacity.

    Raises:
      ValueError: the estimate exceeds ``capacity``; the message suggests smaller blocks.
    """
    needed = vmem_bytes(blocks, head_dim, dtype, segment_ids)
    if needed > capacity:
        raise ValueError(
            f"block sizes block_q={blocks.block_q}, block_kv={blocks.block_kv} need about "
            f"{needed / 2**20:.1f} MiB of VMEM for head_dim={head_dim}, "
            f"dtype={np.dtype(dtype).name}, but the TPU core has {capacity / 2**20:.0f} MiB; "
            "choose smaller BlockSizes"
        )
    return min(capacity, max(MIN_VMEM_LIMIT_BYTES, 2 * needed))
