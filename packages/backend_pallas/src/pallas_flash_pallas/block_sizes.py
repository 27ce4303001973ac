"""Block sizes of the forward and backward kernels, their v5e defaults, and the VMEM-fit
check."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pallas_flash.specs import AttentionSpec

LANES = 128
"""Lanes of a vreg: the minor dimension of every VMEM tile."""

VMEM_CAPACITY_BYTES = 128 * 1024 * 1024
"""VMEM of one TPU v5e TensorCore."""

MIN_VMEM_LIMIT_BYTES = 32 * 1024 * 1024
"""The smallest scoped-VMEM limit the kernel asks Mosaic for (its v5e default is 16 MiB)."""

DQ_VMEM_BUDGET_BYTES = 64 * 1024 * 1024
"""VMEM the backward may give to its query-gradient accumulator and output block; longer
sequences are processed in chunks of query blocks that fit."""


_SIZES = (
    "block_q",
    "block_kv",
    "block_q_compute",
    "backward_block_q",
    "backward_block_kv",
    "backward_block_kv_compute",
)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """How the kernels tile one call.

    A size left None takes the v5e default for the call (`v5e_defaults`). A block at least as
    long as its sequence is clamped to the sequence length (a block equal to the full
    dimension is always legal). A shorter block must be a multiple of 128; the sequence is
    then split into ``ceil(len / block)`` blocks, the last one possibly partial.

    Attributes:
      block_q: forward: query rows resident in VMEM while the K/V blocks stream past.
      block_kv: forward: key/value rows per grid step.
      block_q_compute: forward: the query block is processed in sub-blocks of this many rows,
        one after another in straight-line code; they are independent, so the compiler
        overlaps the matmuls of one with the softmax of another and keeps the MXU busy.
        Clamped to ``block_q``; a multiple of 128 (the last sub-block may be shorter).
      backward_block_q: backward: query rows (with their output gradient) per grid step.
      backward_block_kv: backward: key/value rows resident in VMEM, with their gradients,
        while the query blocks stream past.
      backward_block_kv_compute: backward: the kv block is processed in sub-blocks of this
        many keys, as ``block_q_compute`` in the forward.
      backward_chunk_blocks: backward: query blocks whose gradient is accumulated in VMEM at
        once; None: all of them if they fit in `DQ_VMEM_BUDGET_BYTES`, else as many as fit.
    """

    block_q: int | None = None
    block_kv: int | None = None
    block_q_compute: int | None = None
    backward_block_q: int | None = None
    backward_block_kv: int | None = None
    backward_block_kv_compute: int | None = None
    backward_chunk_blocks: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BlockSizes.{field.name} must be a positive int, got {value!r}")
        for name in ("block_q_compute", "backward_block_kv_compute"):
            value = getattr(self, name)
            if value is not None and value % LANES:
                raise ValueError(f"BlockSizes.{name} must be a multiple of {LANES}, got {value}")

    def for_call(self, spec: AttentionSpec, q_len: int, kv_len: int) -> BlockSizes:
        """The sizes for one call: every None size replaced by its `v5e_defaults`, then each
        block at most its sequence's length.

        Raises:
          ValueError: a block shorter than its sequence is not a multiple of 128.
        """
        defaults = v5e_defaults(spec)
        sizes = {name: getattr(self, name) or getattr(defaults, name) for name in _SIZES}
        for name, length in (
            ("block_q", q_len),
            ("block_kv", kv_len),
            ("backward_block_q", q_len),
            ("backward_block_kv", kv_len),
        ):
            block = sizes[name]
            if block < length and block % LANES:
                raise ValueError(
                    f"BlockSizes.{name}={block} is shorter than the sequence ({length}) and so "
                    f"must be a multiple of {LANES}"
                )
            sizes[name] = min(block, length)
        return dataclasses.replace(self, **sizes)


def v5e_defaults(spec: AttentionSpec) -> BlockSizes:
    """The block sizes tuned on the static v5e schedule (B=1, H=16, head_dim 128, bfloat16,
    N = 4k..16k; the package README has the sweep).

    Forward: without a mask, 4096 x 1024 (the longest query blocks amortise each step's fixed
    cost over the most MXU work); causal, 2048 x 2048 (every block that straddles the
    diagonal starts on it, and a 4096 x 4096 configuration overflows VMEM at 16k); with a
    sliding window, 1024 x 1024 (fewer keys computed past its edges).
    Backward: 1024 x 1024 block pairs in key sub-blocks of 256 (MXU-bound without a mask).
    """
    if spec.window is not None:
        block_q, block_kv = 1024, 1024
    elif spec.causal:
        block_q, block_kv = 2048, 2048
    else:
        block_q, block_kv = 4096, 1024
    return BlockSizes(block_q, block_kv, 256, 1024, 1024, 256)


def _tile_bytes(rows: int, cols: int, dtype: np.dtype) -> int:
    """VMEM bytes of a ``[rows, cols]`` buffer, padded to whole ``(8 * packing, 128)`` tiles."""
    itemsize = np.dtype(dtype).itemsize
    sublanes = 8 * (4 // itemsize)
    return math.ceil(rows / sublanes) * sublanes * math.ceil(cols / LANES) * LANES * itemsize


_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)


def forward_vmem_bytes(
    blocks: BlockSizes, head_dim: int, dtype: np.dtype, segment_ids: bool
) -> int:
    """Estimated VMEM of one forward kernel instance.

    Counts the double-buffered pipeline blocks (q, k, v, output, log-sum-exp, segment ids),
    the scratch (running max and sum ``[block_q, 128]``, accumulator ``[block_q, head_dim]``,
    all float32; the queries' segment ids ``[block_q, 128]``) and the float32 temporaries of
    one row sub-block (scores, probabilities, mask: ``[block_q_compute, block_kv]`` each).
    """
    bq, bkv = blocks.block_q, blocks.block_kv
    pipelined = (
        2 * _tile_bytes(bq, head_dim, dtype)  # q and output
        + 2 * _tile_bytes(bkv, head_dim, dtype)  # k and v
        + _tile_bytes(1, bq, _F32)  # log-sum-exp
    )
    scratch = 2 * _tile_bytes(bq, LANES, _F32) + _tile_bytes(bq, head_dim, _F32)
    if segment_ids:
        pipelined += _tile_bytes(1, bq, _I32) + _tile_bytes(1, bkv, _I32)
        scratch += _tile_bytes(bq, LANES, _I32)
    temporaries = 3 * _tile_bytes(min(blocks.block_q_compute, bq), bkv, _F32)
    return 2 * pipelined + scratch + temporaries


def dq_vmem_bytes(rows: int, head_dim: int, dtype: np.dtype, group: int) -> int:
    """VMEM of the backward's query-gradient accumulator (float32) and its double-buffered
    output block, for ``rows`` query rows of each of ``group`` query heads."""
    return group * (_tile_bytes(rows, head_dim, _F32) + 2 * _tile_bytes(rows, head_dim, dtype))


def backward_vmem_bytes(
    blocks: BlockSizes,
    head_dim: int,
    dtype: np.dtype,
    segment_ids: bool,
    *,
    group: int,
    chunk_rows: int,
) -> int:
    """Estimated VMEM of one backward kernel instance.

    Counts the double-buffered pipeline blocks (q, output gradient, k, v, log-sum-exp and row
    sums, segment ids, dk and dv, at most 4 bytes each), the query-gradient accumulator and
    output of ``chunk_rows`` rows for ``group`` heads (`dq_vmem_bytes`), the dk and dv
    accumulators and the keys' segment ids ``[backward_block_kv, 128]``, and the float32
    temporaries of one key sub-block (scores, probabilities, their gradients, mask:
    ``[backward_block_kv_compute, backward_block_q]`` each).
    """
    bq, bkv = blocks.backward_block_q, blocks.backward_block_kv
    pipelined = (
        2 * _tile_bytes(bq, head_dim, dtype)  # q and output gradient
        + 2 * _tile_bytes(bkv, head_dim, dtype)  # k and v
        + 2 * _tile_bytes(1, bq, _F32)  # log-sum-exp and row sums
        + 2 * _tile_bytes(bkv, head_dim, _F32)  # dk and dv (float32 when partial)
    )
    scratch = 2 * _tile_bytes(bkv, head_dim, _F32)
    if segment_ids:
        pipelined += _tile_bytes(1, bq, _I32) + _tile_bytes(1, bkv, _I32)
        scratch += _tile_bytes(bkv, LANES, _I32)
    temporaries = 5 * _tile_bytes(min(blocks.backward_block_kv_compute, bkv), bq, _F32)
    dq = dq_vmem_bytes(chunk_rows, head_dim, dtype, group)
    return 2 * pipelined + scratch + temporaries + dq


def vmem_limit_bytes(needed: int, blocks: str, capacity: int = VMEM_CAPACITY_BYTES) -> int:
    """The scoped-VMEM limit to compile a kernel with that needs an estimated ``needed``
    bytes: twice the estimate, at least 32 MiB, at most the capacity.

    Args:
      needed: the estimate.
      blocks: what the estimate is for (block sizes, head_dim, dtype), for the error message.
      capacity: VMEM of the core.

    Raises:
      ValueError: the estimate exceeds ``capacity``; the message suggests smaller blocks.
    """
    if needed > capacity:
        raise ValueError(
            f"{blocks} need about {needed / 2**20:.1f} MiB of VMEM, but the TPU core has "
            f"{capacity / 2**20:.0f} MiB; choose smaller BlockSizes"
        )
    return min(capacity, max(MIN_VMEM_LIMIT_BYTES, 2 * needed))
