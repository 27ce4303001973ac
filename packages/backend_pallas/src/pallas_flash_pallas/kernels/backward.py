"""The FlashAttention-2 backward kernel: dq, dk and dv in one pass, from the saved
log-sum-exp.

Layouts: q and dq ``[batch, q_heads, q_len, head_dim]``; the output gradient ``dout``
``[batch, q_heads, q_len, v_head_dim]``; k and dk ``[batch, kv_heads, kv_len, head_dim]``; v
and dv ``[batch, kv_heads, kv_len, v_head_dim]`` (``v_head_dim`` may differ from
``head_dim``: MLA); the forward's log-sum-exp and the row sums ``di = rowsum(dout * out)``,
float32 rows of lanes ``[batch, q_heads, 1, q_len]``.

Grid ``(batch, kv_heads, chunks, kv blocks, group * steps)``. One ``[block_kv, head_dim]``
K/V block stays in VMEM with its float32 dk and dv accumulators while the query blocks of
every query head of its GQA group that see one of its keys (`schedule.QSchedule`) stream
past, so dk and dv are summed over the group in VMEM and written once. The query gradient of
the group's heads is accumulated in VMEM over all kv blocks and written once per chunk; a
chunk is every query block unless the accumulator would not fit in VMEM
(`block_sizes.dq_vmem_budget_bytes`), in which case dk and dv of each chunk are written as
float32 partials and summed afterwards; or, once those partials would take too much HBM
(`split_backward`), the kernel runs over all query blocks without dq, and `backward_dq`
computes dq in a pass of its own.

The kernel itself, what it computes per visited pair of blocks: `backward_kernel`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import interpret, tpu
from pallas_flash.masking import positional_mask
from pallas_flash.specs import AttentionSpec, SegmentIds
from pallas_flash_pallas.blocks.block_sizes import (
    LANES,
    BlockSizes,
    backward_vmem_bytes,
    dq_vmem_budget_bytes,
    dq_vmem_bytes,
    vmem_limit_bytes,
)
from pallas_flash_pallas.blocks.schedule import QSchedule
from pallas_flash_pallas.kernels.backward_dq import query_gradient
from pallas_flash_pallas.kernels.backward_kernel import backward_kernel, head_and_step
from pallas_flash_pallas.kernels.kernel_helpers import (
    broadcast_block,
)

_F32 = jnp.float32


def _chunk_blocks(
    blocks: BlockSizes,
    num_q_blocks: int,
    head_dim: int,
    dtype: np.dtype,
    group: int,
    generation: tpu.TpuGeneration,
) -> int | None:
    """Query blocks per chunk: ``blocks.backward_chunk_blocks`` if set; else None (one chunk)
    when the whole query gradient of a GQA group fits in `dq_vmem_budget_bytes`, else as many
    blocks as fit (at least one)."""
    block_q = blocks.backward_block_q
    budget = dq_vmem_budget_bytes(generation)
    if blocks.backward_chunk_blocks is not None:
        return min(blocks.backward_chunk_blocks, num_q_blocks)
    if dq_vmem_bytes(num_q_blocks * block_q, head_dim, dtype, group) <= budget:
        return None
    return max(1, budget // dq_vmem_bytes(block_q, head_dim, dtype, group))


def _cost(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    schedule: QSchedule,
    *,
    with_dq: bool,
    bias_bytes: int,
) -> pl.CostEstimate:
    """Flops and exponentials of the visited pairs (five matmuls each: three over head_dim,
    two over v_head_dim; without dq four); bytes moved between HBM and VMEM (k, v, dk, dv and
    dq once per chunk, q and dout per visited pair, and ``bias_bytes`` per element of a
    visited pair: the bias and its gradient)."""
    batch, q_heads, _, head_dim = q.shape
    v_head_dim = v.shape[3]
    blocks = batch * q_heads * schedule.visited_blocks
    pairs = blocks * schedule.block_q * schedule.block_kv
    q_bytes = blocks * schedule.block_q * (head_dim + v_head_dim) * q.dtype.itemsize
    kv_bytes = 2 * schedule.num_chunks * (k.nbytes + v.nbytes)
    dq_bytes = q.nbytes if with_dq else 0
    return pl.CostEstimate(
        flops=2 * pairs * ((3 if with_dq else 2) * head_dim + 2 * v_head_dim),
        transcendentals=pairs,
        bytes_accessed=q_bytes
        + kv_bytes
        + dq_bytes
        + 8 * blocks * schedule.block_q
        + bias_bytes * pairs,
    )


def flash_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: SegmentIds | None,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    *,
    spec: AttentionSpec,
    block_sizes: BlockSizes | None = None,
    bias: jax.Array | None = None,
    with_bias_gradient: bool = False,
    devices: int = 1,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Gradients of attention with respect to q, k, v and the bias.

    Args:
      q, k, v, segment_ids, bias, spec: the forward call's (see `forward.flash_forward`).
      out: the forward's output ``[batch, q_heads, q_len, v_head_dim]``.
      lse: the forward's log-sum-exp, ``[batch, q_heads, 1, q_len]`` float32.
      dout: the gradient of the output, like ``out``.
      block_sizes: block sizes (None sizes: the defaults of the TPU generation,
        `block_sizes.default_block_sizes`), before clamping; default `BlockSizes()`.
      with_bias_gradient: whether to compute the bias's gradient.
      devices: how many devices run the kernels at once (inside ``shard_map``), for the
        interpreter (`interpret.jit_kernel`).

    Returns:
      ``(dq, dk, dv, dbias)``, shaped and typed like q, k, v and the bias; ``dbias`` is None
      without ``with_bias_gradient``.

    Raises:
      ValueError: the block sizes are illegal for these lengths or do not fit in VMEM.
    """
    block_sizes = BlockSizes() if block_sizes is None else block_sizes
    di = jnp.sum(out.astype(_F32) * dout.astype(_F32), axis=-1)[:, :, None, :]
    dq, dk, dv, dbias = _backward(
        q,
        k,
        v,
        segment_ids,
        lse,
        di,
        dout,
        bias,
        spec=spec,
        block_sizes=block_sizes,
        with_bias_gradient=with_bias_gradient,
        generation=tpu.current_generation(),
        devices=devices,
    )
    return dq, dk, dv, None if dbias is None else bias_gradient(dbias, bias, spec)


def bias_gradient(dbias: jax.Array, bias: jax.Array, spec: AttentionSpec) -> jax.Array:
    """The bias's gradient from the kernel's ``dbias [batch, q_heads, q_len, kv_len]``
    float32: zero where the positional rules hide a pair (the kernel writes nothing there:
    neither the blocks it skips nor the hidden side of the causal diagonal), summed over the
    axes the bias broadcasts and cast to its dtype."""
    q_len, kv_len = dbias.shape[2:]
    q_pos, kv_pos = jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :]
    visible = positional_mask(q_pos, kv_pos, spec)
    if visible is not None:
        dbias = jnp.where(visible, dbias, 0.0)
    broadcast = tuple(axis for axis in (0, 1) if bias.shape[axis] < dbias.shape[axis])
    return dbias.sum(axis=broadcast, keepdims=True).astype(bias.dtype)


def _flash_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: SegmentIds | None,
    lse: jax.Array,
    di: jax.Array,
    dout: jax.Array,
    bias: jax.Array | None,
    *,
    spec: AttentionSpec,
    block_sizes: BlockSizes,
    with_bias_gradient: bool,
    generation: tpu.TpuGeneration,
    interpret: pltpu.InterpretParams | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """`flash_backward` with the row sums ``di [batch, q_heads, 1, q_len]`` float32, built for
    ``generation``, and the interpreter's settings (None for Mosaic); the bias's gradient
    comes back ``[batch, q_heads, q_len, kv_len]`` float32, before `bias_gradient`."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len, v_head_dim = k.shape[1], k.shape[2], v.shape[3]
    wider = max(head_dim, v_head_dim)  # every block at the wider head_dim: an upper bound
    group = q_heads // kv_heads
    blocks = block_sizes.for_call(
        spec, q_len, kv_len, generation, bias=bias is not None, dtype=q.dtype
    )
    bq, bkv = blocks.backward_block_q, blocks.backward_block_kv
    num_q_blocks = math.ceil(q_len / bq)
    chunk_blocks = _chunk_blocks(blocks, num_q_blocks, head_dim, q.dtype, group, generation)
    num_chunks = 1 if chunk_blocks is None else math.ceil(num_q_blocks / chunk_blocks)
    split = num_chunks > 1 and (
        split_backward(num_chunks, k, v, generation)
        if blocks.backward_split is None
        else blocks.backward_split
    )
    schedule = QSchedule(spec, q_len, kv_len, bq, bkv, None if split else chunk_blocks)
    chunked = schedule.num_chunks > 1
    dq_rows = 0 if split else 8 * math.ceil(schedule.blocks_per_chunk * bq / 8)  # per head
    has_ids = segment_ids is not None
    bias_dtype = None if bias is None else bias.dtype
    limit = vmem_limit_bytes(
        backward_vmem_bytes(
            blocks,
            wider,
            q.dtype,
            has_ids,
            group=group,
            chunk_rows=dq_rows,
            bias=bias_dtype,
            bias_gradient=with_bias_gradient,
        ),
        f"backward block sizes backward_block_q={bq}, backward_block_kv={bkv} with "
        f"head_dim={head_dim}, v_head_dim={v_head_dim}, {q.dtype.name} and {group} query "
        "heads per kv head",
        generation,
    )
    steps = schedule.num_steps

    # Index maps of the grid (b, kv head, chunk c, kv block j, step t) to block indices.
    def q_head_and_block(kvh, c, j, t):
        g, s = head_and_step(t, steps)
        return kvh * group + g, schedule.q_block(c, j, s)

    def q_map(b, kvh, c, j, t):
        h, i = q_head_and_block(kvh, c, j, t)
        return b, h, i, 0

    def row_map(b, kvh, c, j, t):
        h, i = q_head_and_block(kvh, c, j, t)
        return b, h, 0, i

    def kv_map(b, kvh, c, j, t):
        return b, kvh, j, 0

    def q_ids_map(b, kvh, c, j, t):
        return b, 0, q_head_and_block(kvh, c, j, t)[1]

    def kv_ids_map(b, kvh, c, j, t):
        return b, 0, j

    def dq_map(b, kvh, c, j, t):
        return b, kvh, c, 0

    q_spec = pl.BlockSpec((None, None, bq, head_dim), q_map)
    do_spec = pl.BlockSpec((None, None, bq, v_head_dim), q_map)
    k_spec = pl.BlockSpec((None, None, bkv, head_dim), kv_map)
    v_spec = pl.BlockSpec((None, None, bkv, v_head_dim), kv_map)
    row_spec = pl.BlockSpec((None, None, 1, bq), row_map)
    in_specs = [q_spec, k_spec, v_spec, do_spec, row_spec, row_spec]
    args = [q, k, v, dout, lse, di]
    if has_ids:  # both as rows of lanes: free views of [batch, len]
        in_specs += [
            pl.BlockSpec((None, 1, bq), q_ids_map),
            pl.BlockSpec((None, 1, bkv), kv_ids_map),
        ]
        args += [segment_ids.q[:, None, :], segment_ids.kv[:, None, :]]
    if bias is not None:

        def bias_map(b, kvh, c, j, t):
            h, i = q_head_and_block(kvh, c, j, t)
            return *broadcast_block(bias.shape, b, h), i, j

        in_specs.append(pl.BlockSpec((None, None, bq, bkv), bias_map))
        args.append(bias)
    dbias_outs, dbias_specs = [], []
    if with_bias_gradient:

        def dbias_map(b, kvh, c, j, t):
            h, i = q_head_and_block(kvh, c, j, t)
            return b, h, i, j

        dbias_outs.append(jax.ShapeDtypeStruct((batch, q_heads, q_len, kv_len), _F32))
        dbias_specs.append(pl.BlockSpec((None, None, bq, bkv), dbias_map))
    dq_block_rows = schedule.blocks_per_chunk * bq if chunked else q_len
    dq_outs = [] if split else [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    dq_specs = [] if split else [pl.BlockSpec((None, group, dq_block_rows, head_dim), dq_map)]
    if chunked:  # float32 partials of each chunk, summed below
        dkv_shapes = [
            jax.ShapeDtypeStruct((batch, kv_heads, schedule.num_chunks, kv_len, dim), _F32)
            for dim in (head_dim, v_head_dim)
        ]
        dkv_specs = [
            pl.BlockSpec((None, None, None, bkv, dim), lambda b, kvh, c, j, t: (b, kvh, c, j, 0))
            for dim in (head_dim, v_head_dim)
        ]
    else:
        dkv_shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k, v)]
        dkv_specs = [k_spec, v_spec]
    precision = lax.Precision.HIGHEST if q.dtype == np.float32 else None
    kernel = functools.partial(
        backward_kernel,
        spec=spec,
        schedule=schedule,
        group=group,
        block_kv_compute=blocks.backward_block_kv_compute,
        dq_rows=dq_rows,
        segment_ids=has_ids,
        bias=bias is not None,
        with_bias_gradient=with_bias_gradient,
        with_dq=not split,
        precision=precision,
    )
    bias_bytes = (0 if bias_dtype is None else bias_dtype.itemsize) + 4 * with_bias_gradient
    outs = pl.pallas_call(
        kernel,
        out_shape=(*dq_outs, *dkv_shapes, *dbias_outs),
        grid=(batch, kv_heads, schedule.num_chunks, schedule.num_kv_blocks, group * steps),
        in_specs=in_specs,
        out_specs=(*dq_specs, *dkv_specs, *dbias_specs),
        scratch_shapes=[
            *([] if split else [pltpu.VMEM((group * dq_rows, head_dim), _F32)]),
            pltpu.VMEM((bkv, head_dim), _F32),
            pltpu.VMEM((bkv, v_head_dim), _F32),
            *([pltpu.VMEM((bkv, LANES), jnp.int32)] if has_ids else []),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary", "arbitrary"),
            vmem_limit_bytes=limit,
        ),
        cost_estimate=_cost(q, k, v, schedule, with_dq=not split, bias_bytes=bias_bytes),
        interpret=False if interpret is None else interpret,
        name="pallas_flash_backward_dkdv" if split else "pallas_flash_backward",
    )(*args)
    dq, (dk, dv), dbias = outs[: len(dq_outs)], outs[len(dq_outs) : len(dq_outs) + 2], None
    if with_bias_gradient:
        dbias = outs[-1]
    if chunked:
        dk, dv = (x.sum(axis=2).astype(k.dtype) for x in (dk, dv))  # v has k's dtype
    if split:
        dq = [query_gradient(q, k, v, segment_ids, lse, di, dout, bias, spec=spec, blocks=blocks,
                             generation=generation, interpret=interpret)]  # fmt: skip
    return dq[0], dk, dv, dbias


SPLIT_HBM_SHARE = 0.25
"""`split_backward` splits once the chunked backward's partials would take more than this
share of the chip's HBM."""


def split_backward(
    num_chunks: int, k: jax.Array, v: jax.Array, generation: tpu.TpuGeneration
) -> bool:
    """Whether the backward runs as two kernels, dk and dv (one pass over the queries, no
    dq) then dq (`backward_dq`), rather than in ``num_chunks`` chunks of query blocks.

    Chunks cost little time (float32 dk and dv partials of each chunk, summed afterwards) but
    HBM: ``num_chunks x (k + v)`` in float32, growing with the square of the sequence; they
    capped one v5e chip at 196,608 tokens (B=1, 16 heads, bfloat16). Two kernels need no HBM
    beyond the arrays themselves but recompute the scores and their gradient for dq: seven
    matmuls a pair, not five. So the backward splits only once the partials would take more
    than `SPLIT_HBM_SHARE` of the chip's HBM (v5e, 16 query heads of 128, bfloat16, with 16
    or 4 kv heads: past 131,072 tokens)."""
    partials = num_chunks * (k.size + v.size) * 4
    return num_chunks > 1 and partials > SPLIT_HBM_SHARE * generation.hbm_bytes


_backward = interpret.jit_kernel(
    _flash_backward, ("spec", "block_sizes", "with_bias_gradient", "generation")
)
