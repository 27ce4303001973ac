"""Block sizes of the forward and backward kernels, their defaults per TPU generation, and
the VMEM-fit check."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from pallas_flash.specs import AttentionSpec
from pallas_flash.tpu import TpuGeneration, scoped_vmem_limit

LANES = 128
"""Lanes of a vreg: the minor dimension of every VMEM tile."""


def dq_vmem_budget_bytes(generation: TpuGeneration) -> int:
    """VMEM the backward may give to its query-gradient accumulator and output block: half the
    core's (64 MiB on v5e); longer sequences are processed in chunks of query blocks that fit."""
    return generation.vmem_bytes // 2


_SIZES = (
    "block_q",
    "block_kv",
    "block_q_compute",
    "backward_block_q",
    "backward_block_kv",
    "backward_block_kv_compute",
    "full_block_compute",
)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """How the kernels tile one call.

    A size left None takes the default of the call and the TPU generation
    (`default_block_sizes`), balanced over the sequence (`balanced`). A block at least as long
    as its sequence is clamped to the sequence length (a block equal to the full dimension is
    always legal). A shorter block must be a multiple of 128; the sequence is then split into
    ``ceil(len / block)`` blocks, the last one possibly partial.

    Attributes:
      block_q: forward: query rows resident in VMEM while the K/V blocks stream past.
      block_kv: forward: key/value rows per grid step.
      block_q_compute: forward: a kv block that a mask crosses is folded into the query block
        in sub-blocks of this many rows, one after another in straight-line code; they are
        independent, so the compiler overlaps the matmuls of one with the softmax of another
        and keeps the MXU busy. Clamped to ``block_q``; a multiple of 128 (the last sub-block
        may be shorter).
      backward_block_q: backward: query rows (with their output gradient) per grid step.
      backward_block_kv: backward: key/value rows resident in VMEM, with their gradients,
        while the query blocks stream past.
      backward_block_kv_compute: backward: the kv block is processed in sub-blocks of this
        many keys, as ``block_q_compute`` in the forward.
      backward_chunk_blocks: backward: query blocks whose gradient is accumulated in VMEM at
        once; None: all of them if they fit in `dq_vmem_budget_bytes`, else as many as fit.
      backward_split: backward: True runs dk/dv and dq as two passes whenever the query
        gradient takes more than one chunk, False never (float32 dk/dv partials per chunk);
        None: as `backward.split_backward` decides (when the partials would take more than
        a quarter of the chip's HBM).
      full_block_compute: forward: a kv block that no mask crosses (every key visible to
        every row, e.g. below the causal diagonal) is folded in tiles of this many query rows
        by as many keys (at most ``block_kv``), as ``block_q_compute`` (which then applies to
        masked blocks only): each weight tile pushed into an MXU serves this many rows
        (`full_block_tiles`). A multiple of 128.
    """

    block_q: int | None = None
    block_kv: int | None = None
    block_q_compute: int | None = None
    backward_block_q: int | None = None
    backward_block_kv: int | None = None
    backward_block_kv_compute: int | None = None
    backward_chunk_blocks: int | None = None
    full_block_compute: int | None = None
    backward_split: bool | None = None

    def __post_init__(self) -> None:
        if self.backward_split not in (None, True, False):
            split = self.backward_split
            raise ValueError(
                f"BlockSizes.backward_split must be True, False or None, got {split!r}"
            )
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None or field.name == "backward_split":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BlockSizes.{field.name} must be a positive int, got {value!r}")
        for name in ("block_q_compute", "backward_block_kv_compute", "full_block_compute"):
            value = getattr(self, name)
            if value is not None and value % LANES:
                raise ValueError(f"BlockSizes.{name} must be a multiple of {LANES}, got {value}")

    def for_call(
        self,
        spec: AttentionSpec,
        q_len: int,
        kv_len: int,
        generation: TpuGeneration,
        *,
        bias: bool = False,
        dtype: np.dtype | None = None,
    ) -> BlockSizes:
        """The sizes for one call on ``generation`` with inputs of ``dtype`` (None: 16-bit):
        every None size replaced by its default (`default_block_sizes`; ``bias``: the call
        streams a bias) balanced over its sequence (`balanced`), the kv block the whole key
        sequence if both are short (`whole_kv_block`); then every block at most its
        sequence's length.

        Raises:
          ValueError: a block shorter than its sequence is not a multiple of 128.
        """
        defaults = default_block_sizes(spec, generation, bias=bias, dtype=dtype)
        sizes = {name: getattr(self, name) for name in _SIZES}
        for name, length in (
            ("block_q", q_len),
            ("block_kv", kv_len),
            ("block_q_compute", None),
            ("backward_block_q", q_len),
            ("backward_block_kv", kv_len),
            ("backward_block_kv_compute", None),
            ("full_block_compute", None),
        ):
            block = sizes[name]
            if block is None:
                block = getattr(defaults, name)
                block = block if length is None else balanced(block, length)
                if name == "block_kv" and max(q_len, kv_len) <= whole_kv_block(spec, generation):
                    block = kv_len
            elif length is not None and block < length and block % LANES:
                raise ValueError(
                    f"BlockSizes.{name}={block} is shorter than the sequence ({length}) and so "
                    f"must be a multiple of {LANES}"
                )
            sizes[name] = block if length is None else min(block, length)
        return dataclasses.replace(self, **sizes)


def balanced(block: int, length: int) -> int:
    """The block, a multiple of 128 and at most ``block``, that cuts ``length`` with the least
    padding for the fewest blocks: the fewest blocks, at least as many as ``block`` needs,
    that pad the sequence by at most `MAX_PADDING` of its length (else the least padding of
    blocks down to half of ``block``), then as equal as multiples of 128 allow.

    E.g. 6144 rows in blocks of 4096 become two of 3072, not 4096 and a half-empty 2048; 5120
    in blocks of 2048 four of 1280, not three of 1792 (5,376 rows, 5 % padding); 100,000 in
    blocks of 4096 27 of 3712 (100,224 rows), not 25 (102,400)."""
    if block >= length:
        return length
    tiles = math.ceil(length / LANES)
    fewest = math.ceil(length / block)
    sizes = []
    for count in range(fewest, 2 * fewest + 1):
        size = LANES * math.ceil(tiles / count)
        if 2 * size < block:
            break
        padding = math.ceil(length / size) * size - length
        if padding <= MAX_PADDING * length:
            return size
        sizes.append((padding, -size))
    return -min(sizes)[1]


MAX_PADDING = 0.01
"""`balanced` pads a sequence by at most this fraction of its length when some block count
allows it: padded rows are computed (and masked) like real ones."""


def full_block_tiles(block_q: int, block_kv: int, tile: int) -> list[tuple[int, int, int, int]]:
    """The tiles ``(first_row, rows, first_key, keys)`` a block no mask crosses is folded in:
    ``tile`` query rows by ``min(tile, block_kv)`` keys (each weight tile pushed into an MXU
    serves ``tile`` rows), key ranges one after another. When one key range spans the block,
    the last of its row tiles is cut into three quarters and a quarter of its rows (multiples
    of 128). A block of at most ``tile`` rows is folded in tiles of half as many, uncut.

    The cut shortens the step's end, where the MXU idles while the last tile's softmax
    drains: 6144 x 1024 in tiles of 2048 rows (2048, 2048, 1536, 512) schedules 26,059 v5e
    cycles a step against 26,541 for (2048, 2048, 1024, 1024) and 26,974 uncut. With two key
    ranges (causal 2048 x 2048 in 1024 tiles) the extra tile's weight pushes cost more than
    the cut saves if pushes do not overlap the matmuls (N=12288 causal with pushes at 16
    cycles: 5,887,296 cycles against 5,764,608), so such blocks are not cut. One tile could
    not overlap its softmax with another tile's matmuls: 1536 x 768 without a mask schedules
    5,934 cycles a step in one tile against 5,330 in 1024 + 512 rows.
    """
    cut = block_q > tile
    if not cut:
        tile = max(LANES, tile // 2 // LANES * LANES)
    keys = min(tile, block_kv)
    rows = [min(tile, block_q - first) for first in range(0, block_q, tile)]
    quarter = rows[-1] // 4 // LANES * LANES
    if cut and keys == block_kv and quarter:
        rows[-1:] = [rows[-1] - quarter, quarter]
    starts = list(itertools.accumulate(rows[:-1], initial=0))
    return [
        (first_row, num_rows, first_key, min(keys, block_kv - first_key))
        for first_key in range(0, block_kv, keys)
        for first_row, num_rows in zip(starts, rows, strict=True)
    ]


def whole_kv_block(spec: AttentionSpec, generation: TpuGeneration) -> int:
    """The longest sequences (queries and keys) whose default kv block is the whole key
    sequence: 2048 without a mask on v5e and v6e (a quarter of the longest default block), else
    0. The query block is then the whole query sequence too, folded in 1024-row tiles.

    Each grid step has a fixed cost; with one kv step per query block it is paid once. Static
    v5e cycles without a mask: N=1536 in one kv block 152,284 (critical path 151,119, pushes at
    16 cycles 172,032) against 170,560 (163,776, 172,032) in two of 768, where jax's flash
    kernel with 1536 blocks needs 187,296 (151,056; 187,296); N=2048 266,684 (265,791;
    294,912) against 297,977 (269,725; 297,977) in two of 1024.
    """
    if spec.causal or spec.window is not None:
        return 0
    return _longest_block(generation) // 4


def default_block_sizes(
    spec: AttentionSpec,
    generation: TpuGeneration,
    *,
    bias: bool = False,
    dtype: np.dtype | None = None,
) -> BlockSizes:
    """The default block sizes of a call on ``generation`` with inputs of ``dtype`` (None:
    16-bit), before balancing.

    Tuned on the static v5e schedule (B=1, H=16, head_dim 128, bfloat16, N = 4k..16k; the
    package README has the sweeps) for v5e, and v6e, which has as much VMEM:

    - Forward without a mask: 8192 x 1024 in tiles of 2048 rows by the block's 1024 keys,
      the last cut 3:1 (`full_block_tiles`). Each grid step has a fixed cost (about 1,200
      cycles of v5e's schedule: the MXU idles while the last tile's softmax drains) that
      longer query blocks amortise and the cut shortens: at N=16384 query blocks of 4096
      schedule at 91.6 % of the MXU floor, 8192 at 94.7 %, 16384 at 96.4 % (but compile 2.3
      times as long as 8192, and do not fit head_dim 256 in float32). Each weight tile
      pushed into an MXU serves 2048 rows (one push per 16 matmuls, as splash 2048/2048), so
      the kernel leads jax's kernels whether or not pushes overlap the matmuls: 1024-row
      tiles scheduled 0.3 % faster at N=8192 but fell 3 % behind splash 2048/2048 with
      pushes at 16 cycles and no overlap.
    - Causal: 2048 x 2048 (every block that straddles the diagonal starts on it); blocks on
      the diagonal in sub-blocks of 256 rows (a sub-block computes the keys up to its last
      row: shorter sub-blocks compute fewer masked scores), blocks below it in tiles of 1024
      x 1024 (`full_block_compute`: a weight tile serves 1024 rows, one push per eight
      matmuls; at N=12288 the kernel schedules 5,358,209 cycles, not 5,397,649 in 256-row
      sub-blocks, and 5,764,608 with pushes at 16 cycles and no overlap, not 7,239,168).
    - With a sliding window: 1024 x 1024 (fewer keys computed past its edges), sub-blocks of
      256 rows, tiles of 512 x 512 inside the window (N=8192, window 2048: 1,632,251 cycles
      of schedule, 1,949,696 with pushes at 16, against 1,643,691 and 2,080,512 in 256-row
      sub-blocks, and 1,697,131 and 1,892,352 in one 1024 tile).
    - Backward: 1024 x 1024 block pairs in key sub-blocks of 256 (MXU-bound without a mask).
    - With a ``bias``, forward query blocks of at most `BIAS_BLOCK_Q` rows: each step streams
      a ``[block_q, block_kv]`` bias block beside K and V (8 MiB in float32 at 2048 x 1024,
      double-buffered).
    - In float32 (32-bit inputs), forward query blocks of at most `FLOAT32_BLOCK_Q` rows.

    Every block fits the largest supported call (head_dim 256, float32, segment ids) in the
    generation's VMEM: at most 8192 rows on v5e and v6e (128 MiB), 2048 on v5p and v7x (64
    MiB), 512 on v4 (16 MiB); tiles of unmasked blocks at most a quarter of that (2048 on v5e
    and v6e, 512 on v5p, 128 on v4), but at least `WIDE_MXU_TILE` rows where the block
    allows on 256-wide MXUs (v7x: 1024, half its block; the tile's weights serve twice the
    rows per push). Static v7x against the quarter's 512: 1.2 to 9 % faster at every shape
    tried (forward N=16384, 16 heads of 128: 6.03 -> 5.43 ms; causal 3.09 -> 2.86 ms; 32
    heads of 64 at N=8192: 6.15 -> 5.58 ms; 8 heads of 256: 2.93 -> 2.88 ms; N=1024 batch 16
    equal); on v5p's 128-wide MXUs within 1.3 % either way, so v5p keeps its quarter.
    """
    compute, tile = 256, 1024
    if spec.window is not None:
        block_q, block_kv, tile = 1024, 1024, 512
    elif spec.causal:
        block_q, block_kv = 2048, 2048
    else:
        block_q, block_kv, compute, tile = 8192, 1024, 1024, 2048
    if bias:
        block_q = min(block_q, BIAS_BLOCK_Q)
    if dtype is not None and np.dtype(dtype).itemsize >= 4:
        block_q = min(block_q, FLOAT32_BLOCK_Q)
    longest = _longest_block(generation)
    backward = min(1024, longest)
    widest_tile = longest // 4
    if generation.mxu_width >= 256:
        widest_tile = max(widest_tile, min(WIDE_MXU_TILE, longest // 2))
    return BlockSizes(
        min(block_q, longest),
        min(block_kv, longest),
        min(compute, longest),
        backward,
        backward,
        256,
        full_block_compute=min(tile, widest_tile),
    )


WIDE_MXU_TILE = 1024
"""The least tile of an unmasked block on 256-wide MXUs where the block holds two
(`default_block_sizes`)."""


BIAS_BLOCK_Q = 2048
"""The longest default forward query block of a call with a bias (`default_block_sizes`)."""

FLOAT32_BLOCK_Q = 2048
"""The longest default forward query block of a float32 call (`default_block_sizes`): one
tile of the unmasked defaults. A float32 matmul runs as several bfloat16 passes, so one tile
already amortises a grid step's fixed cost, and Mosaic compiles a block's tiles unrolled:
static v5e, head_dim 256 at N=8192, 2048-row blocks schedule exactly the cycles of 8192-row
ones (4.186 ms; calibrated 4.344 against 4.337 ms, 0.2 %, inside the ±8.4 % band), and the
forward compiles for v5e in 19 s on a 2-core CPU host, against 113 s in 8192-row blocks
(that one beside the rest of the test suite)."""


_LONGEST_BLOCK = {128: 8192, 64: 2048}
"""MiB of VMEM per core -> the longest default query or kv block (`default_block_sizes`)."""


def _longest_block(generation: TpuGeneration) -> int:
    """The longest default query or kv block on ``generation`` (512 on cores with less VMEM
    than `_LONGEST_BLOCK` lists)."""
    return _LONGEST_BLOCK.get(generation.vmem_bytes >> 20, 512)


def _tile_bytes(rows: int, cols: int, dtype: np.dtype) -> int:
    """VMEM bytes of a ``[rows, cols]`` buffer, padded to whole ``(8 * packing, 128)`` tiles."""
    itemsize = np.dtype(dtype).itemsize
    sublanes = 8 * (4 // itemsize)
    return math.ceil(rows / sublanes) * sublanes * math.ceil(cols / LANES) * LANES * itemsize


_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)


LIVE_SUB_BLOCKS = 4
"""Row (forward) or key (backward) sub-blocks whose temporaries the compiler keeps alive at
once: the sub-blocks are unrolled and interleaved, and Mosaic keeps their score-sized values
in VMEM. Calibrated on compiled v5e kernels (forward 4096 x 4096 in 16 sub-blocks of 256 rows
at head_dim 128 needs 68.2 MiB, 54 of them such temporaries: under this bound's 64)."""


FULL_BLOCK_SCORE_COPIES = 2
"""Float32 ``[block_q, block_kv]`` score blocks whose worth of temporaries the compiler keeps
alive at most while it folds an unmasked block in tiles (`full_block_tiles`), whatever the
tiles' size. Calibrated on compiled v5e kernels (8192 x 1024 without a mask, 32 MiB of scores:
Mosaic needs 28-29 MiB beyond the pipeline and scratch at head_dim 128 in bfloat16 in tiles
of 1024 x 1024 or 2048 x 1024, 48 and 61 MiB at head_dim 256 in float32 with segment ids)."""


def _temporaries(rows: int, cols: int, sub_blocks: int, per_sub_block: int) -> int:
    """VMEM of the float32 ``[rows, cols]`` temporaries, ``per_sub_block`` of them, of the
    sub-blocks alive at once (at most `LIVE_SUB_BLOCKS` of ``sub_blocks``)."""
    live = min(sub_blocks, LIVE_SUB_BLOCKS)
    return live * per_sub_block * _tile_bytes(rows, cols, _F32)


def forward_vmem_bytes(
    blocks: BlockSizes,
    head_dim: int,
    dtype: np.dtype,
    segment_ids: bool,
    bias: np.dtype | None = None,
) -> int:
    """Estimated VMEM of one forward kernel instance: an upper bound of what Mosaic allocates.

    Counts the double-buffered pipeline blocks (q, k, v, output, log-sum-exp, segment ids,
    the ``[block_q, block_kv]`` block of a bias of dtype ``bias``),
    the scratch (running max and sum ``[block_q, 128]``, accumulator ``[block_q, head_dim]``,
    all float32; the queries' segment ids ``[block_q, 128]``) and the float32 temporaries
    (scores, probabilities, mask, exponentials: ``[block_q_compute, block_kv]`` each) of the
    sub-blocks alive at once (`LIVE_SUB_BLOCKS`), or those of the unmasked block's tiles
    (`full_block_tiles`, at most `FULL_BLOCK_SCORE_COPIES` score blocks' worth) if more.
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
    if bias is not None:
        pipelined += _tile_bytes(bq, bkv, bias)
    rows = min(blocks.block_q_compute, bq)
    temporaries = _temporaries(rows, bkv, math.ceil(bq / rows), 4)
    if blocks.full_block_compute is not None:
        tiles = full_block_tiles(bq, bkv, blocks.full_block_compute)
        _, tile_rows, _, tile_keys = tiles[0]
        in_tiles = _temporaries(tile_rows, tile_keys, len(tiles), 4)
        block_copies = FULL_BLOCK_SCORE_COPIES * _tile_bytes(bq, bkv, _F32)
        temporaries = max(temporaries, min(in_tiles, block_copies))
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
    bias: np.dtype | None = None,
    bias_gradient: bool = False,
) -> int:
    """Estimated VMEM of one backward kernel instance: an upper bound of what Mosaic
    allocates.

    Counts the double-buffered pipeline blocks (q, output gradient, k, v, log-sum-exp and row
    sums, segment ids, dk and dv, at most 4 bytes each, a bias block of dtype ``bias`` and,
    with ``bias_gradient``, its float32 gradient, ``[backward_block_q, backward_block_kv]``
    each), the query-gradient accumulator and
    output of ``chunk_rows`` rows for ``group`` heads (`dq_vmem_bytes`), the dk and dv
    accumulators and the keys' segment ids ``[backward_block_kv, 128]``, and the float32
    temporaries (scores, probabilities, their gradients, mask:
    ``[backward_block_kv_compute, backward_block_q]`` each) of the key sub-blocks alive at
    once (`LIVE_SUB_BLOCKS`).
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
    if bias is not None:
        pipelined += _tile_bytes(bq, bkv, bias)
    if bias_gradient:
        pipelined += _tile_bytes(bq, bkv, _F32)
    keys = min(blocks.backward_block_kv_compute, bkv)
    temporaries = _temporaries(keys, bq, math.ceil(bkv / keys), 5)
    dq = dq_vmem_bytes(chunk_rows, head_dim, dtype, group)
    return 2 * pipelined + scratch + temporaries + dq


def dq_kernel_vmem_bytes(
    block_q: int,
    block_kv: int,
    rows_compute: int,
    head_dim: int,
    dtype: np.dtype,
    segment_ids: bool,
    bias: np.dtype | None = None,
) -> int:
    """Estimated VMEM of one query-gradient kernel instance (`backward_dq`): an upper bound.

    Counts the double-buffered pipeline blocks (q, output gradient, k, v, dq, log-sum-exp and row
    sums, segment ids, a ``[block_q, block_kv]`` bias block of dtype ``bias``), the scratch (dq
    ``[block_q, head_dim]`` float32, the statistics and the queries' ids as ``[block_q, 128]``
    columns) and the float32 temporaries (scores, probabilities, their gradients, mask:
    ``[rows_compute, block_kv]`` each) of the row sub-blocks alive at once (`LIVE_SUB_BLOCKS`).
    """
    pipelined = (
        3 * _tile_bytes(block_q, head_dim, dtype)  # q, output gradient and dq
        + 2 * _tile_bytes(block_kv, head_dim, dtype)  # k and v
        + 2 * _tile_bytes(1, block_q, _F32)  # log-sum-exp and row sums
    )
    scratch = _tile_bytes(block_q, head_dim, _F32) + 2 * _tile_bytes(block_q, LANES, _F32)
    if segment_ids:
        pipelined += _tile_bytes(1, block_q, _I32) + _tile_bytes(1, block_kv, _I32)
        scratch += _tile_bytes(block_q, LANES, _I32)
    if bias is not None:
        pipelined += _tile_bytes(block_q, block_kv, bias)
    rows = min(rows_compute, block_q)
    temporaries = _temporaries(rows, block_kv, -(-block_q // rows), 5)
    return 2 * pipelined + scratch + temporaries


def vmem_limit_bytes(needed: int, blocks: str, generation: TpuGeneration) -> int:
    """The scoped-VMEM limit to compile a kernel with that needs an estimated ``needed``
    bytes on ``generation``: `pallas_flash.tpu.scoped_vmem_limit` (the estimate with
    headroom, at least 32 MiB, at most the core's VMEM).

    Args:
      needed: the estimate.
      blocks: what the estimate is for (block sizes, head_dim, dtype), for the error message.
      generation: the TPU the kernel is built for.

    Raises:
      ValueError: the estimate exceeds the core's VMEM; the message suggests smaller blocks.
    """
    capacity = generation.vmem_bytes
    if needed > capacity:
        raise ValueError(
            f"{blocks} need about {needed / 2**20:.1f} MiB of VMEM, but a TPU {generation.name} "
            f"core has {capacity / 2**20:.0f} MiB; choose smaller BlockSizes"
        )
    return scoped_vmem_limit(needed, generation)
