"""The query-gradient kernel of the split backward, for sequences too long for one pass.

`backward` computes dq, dk and dv in one pass with a VMEM accumulator for dq of every query
row; past that accumulator's size it would need float32 dk/dv partials per chunk of rows,
which cost HBM (`backward.split_backward`). Then dk and dv come from the same pass without
dq, and dq from this kernel, a forward-shaped pass: one ``[block_q, head_dim]`` query block
(with its output gradient) stays in VMEM with its float32 gradient while the kv blocks that
`schedule.KvSchedule` picks for it stream past. Nothing beyond the arrays themselves lives in
HBM.

Layouts as `backward`'s: q and dq ``[batch, q_heads, q_len, head_dim]``, dout ``[batch,
q_heads, q_len, v_head_dim]``, k ``[batch, kv_heads, kv_len, head_dim]``, v ``[batch,
kv_heads, kv_len, v_head_dim]``, the log-sum-exp and row sums ``di`` float32 rows of lanes
``[batch, q_heads, 1, q_len]``, an optional bias ``[batch or 1, q_heads or 1, q_len, kv_len]``.

Grid ``(batch, q_heads, q blocks, kv steps)``, the kv axis sequential. Per visited pair, in
float32, in row sub-blocks of the query block: ``s = softcap(q k^T * sm_scale)`` (plus the
bias), ``p =
exp(s - lse)`` (zero where hidden), ``dp = dout v^T``, ``ds = p (dp - di)`` times the
softcap's derivative, ``dq += ds k``; dq is scaled by ``sm_scale`` once, at the end. Three
matmuls a pair. Out-of-range keys of a partial last block are zeroed before the matmuls that
sum over them; out-of-range query rows are never written back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import tpu
from pallas_flash.masking import apply_softcap, positional_mask
from pallas_flash.specs import AttentionSpec, SegmentIds
from pallas_flash_pallas.blocks.block_sizes import (
    LANES,
    BlockSizes,
    dq_kernel_vmem_bytes,
    vmem_limit_bytes,
)
from pallas_flash_pallas.blocks.schedule import BlockKind, KvSchedule
from pallas_flash_pallas.kernels.kernel_helpers import (
    NN,
    NT,
    both,
    broadcast_block,
    lanes,
    query_grid_maps,
    recomputed_probabilities,
    when,
    zero_rows_from,
)

_F32 = jnp.float32


def _kernel(
    *refs: jax.Ref,
    spec: AttentionSpec,
    schedule: KvSchedule,
    rows_compute: int,
    segment_ids: bool,
    bias: bool,
    precision: lax.Precision | None,
) -> None:
    """One grid step ``(b, h, i, j)``: folds kv block ``schedule.kv_block(i, j)`` into the
    gradient of query block ``i``; writes it at the last step.

    Refs: inputs q ``[block_q, head_dim]``, k ``[block_kv, head_dim]``, v ``[block_kv,
    v_head_dim]``, dout ``[block_q, v_head_dim]``, log-sum-exp and row sums ``[1, block_q]``, with
    segment ids those of the queries ``[1, block_q]`` and of the keys ``[1, block_kv]``, with a bias
    its ``[block_q, block_kv]`` block; output dq ``[block_q, head_dim]``; scratch: its float32
    accumulator, the log-sum-exp and row sums as equal-lane columns ``[block_q, 128]`` float32 and,
    with segment ids, the queries' ids as columns ``[block_q, 128]`` int32.
    """
    num_inputs = 6 + 2 * segment_ids + bias
    q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *id_refs = refs[:num_inputs]
    bias_ref = id_refs.pop() if bias else None
    dq_ref, dq_acc, lse_cols, di_cols, *id_scratch = refs[num_inputs:]
    q_ids_ref, kv_ids_ref = id_refs or (None, None)
    ids_ref = id_scratch[0] if id_scratch else None
    i, j = pl.program_id(2), pl.program_id(3)
    block_q, block_kv = schedule.block_q, schedule.block_kv
    kv_block = schedule.kv_block(i, j)
    partial_kv = schedule.kv_len % block_kv != 0

    def columns(row: jax.Array) -> jax.Array:  # [1, block_q] -> [block_q, 128], equal lanes
        return jnp.broadcast_to(row, (LANES, block_q)).T

    @pl.when(j == 0)
    def _start() -> None:
        dq_acc[...] = jnp.zeros(dq_acc.shape, _F32)
        lse_cols[...] = columns(lse_ref[...])
        di_cols[...] = columns(di_ref[...])
        if segment_ids:
            ids_ref[...] = columns(q_ids_ref[...])

    def fold_rows(first_row: int, num_rows: int, masked: bool) -> None:
        """Folds the kv block into rows ``first_row ..`` of the query block, masked by the
        causal, window and range rules if ``masked``."""
        rows = pl.ds(first_row, num_rows)
        q, do, k, v = q_ref[rows, :], do_ref[rows, :], k_ref[...], v_ref[...]
        key_pos = kv_block * block_kv
        if masked and partial_kv:  # dq sums over keys: garbage keys must be zeros
            k = zero_rows_from(k, key_pos, schedule.kv_len)
            v = zero_rows_from(v, key_pos, schedule.kv_len)
        s = lax.dot_general(q, k, NT, preferred_element_type=_F32, precision=precision)
        s = apply_softcap(s * spec.sm_scale, spec.softcap)  # [num_rows, block_kv]
        visible = None
        if masked:
            q_pos = i * block_q + first_row + lax.broadcasted_iota(jnp.int32, s.shape, 0)
            kv_pos = key_pos + lax.broadcasted_iota(jnp.int32, s.shape, 1)
            visible = positional_mask(q_pos, kv_pos, spec)
            if partial_kv:
                visible = both(visible, kv_pos < schedule.kv_len)
        if segment_ids:
            visible = both(visible, lanes(ids_ref[rows, :], block_kv) == kv_ids_ref[...])
        logits = s + bias_ref[rows, :].astype(_F32) if bias else s
        p = recomputed_probabilities(logits, lanes(lse_cols[rows, :], block_kv), visible, bias)
        dp = lax.dot_general(do, v, NT, preferred_element_type=_F32, precision=precision)
        ds = p * (dp - lanes(di_cols[rows, :], block_kv))
        if spec.softcap is not None:
            ds = ds * (1.0 - jnp.square(s * (1.0 / spec.softcap)))
        dq_acc[rows, :] += lax.dot_general(
            ds.astype(k.dtype), k, NN, preferred_element_type=_F32, precision=precision
        )

    def fold(masked: bool) -> None:
        """Folds the kv block in, one row sub-block after another (unrolled)."""
        for first_row in range(0, block_q, rows_compute):
            fold_rows(first_row, min(rows_compute, block_q - first_row), masked)

    visited = True if schedule.visits_every_step else schedule.is_visited(i, j)
    kinds = schedule.kinds
    if kinds == {BlockKind.FULL}:
        when(visited, functools.partial(fold, False))
    elif BlockKind.FULL not in kinds:
        when(visited, functools.partial(fold, True))
    else:
        full = schedule.kind(i, kv_block) == BlockKind.FULL
        when(visited & full, functools.partial(fold, False))
        when(visited & ~full, functools.partial(fold, True))

    @pl.when(j == schedule.num_steps - 1)
    def _finish() -> None:
        dq_ref[...] = (dq_acc[...] * spec.sm_scale).astype(dq_ref.dtype)


def _cost(q: jax.Array, k: jax.Array, v: jax.Array, schedule: KvSchedule) -> pl.CostEstimate:
    """Flops and exponentials of the visited pairs (three matmuls each: two over head_dim,
    one over v_head_dim); bytes moved between HBM and VMEM (q, dout, dq and the row
    statistics once, a K and a V block per visited block)."""
    batch, q_heads, q_len, head_dim = q.shape
    v_head_dim = v.shape[3]
    blocks = batch * q_heads * schedule.visited_blocks
    pairs = blocks * schedule.block_q * schedule.block_kv
    kv_bytes = blocks * schedule.block_kv * (head_dim + v_head_dim) * k.dtype.itemsize
    q_bytes = 2 * q.nbytes + q.nbytes // head_dim * v_head_dim + 8 * batch * q_heads * q_len
    return pl.CostEstimate(
        flops=2 * pairs * (2 * head_dim + v_head_dim),
        transcendentals=pairs,
        bytes_accessed=q_bytes + kv_bytes,
    )


def query_gradient(
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
    blocks: BlockSizes,
    generation: tpu.TpuGeneration,
    interpret: pltpu.InterpretParams | None,
) -> jax.Array:
    """dq ``[batch, q_heads, q_len, head_dim]`` in q's dtype (layouts in the module doc), with
    the backward's block sizes for this call (``blocks``, already `BlockSizes.for_call`:
    ``backward_block_q`` rows per query block, ``backward_block_kv`` keys per kv block, row
    sub-blocks of ``backward_block_kv_compute``), built for ``generation``, with the
    interpreter's settings or None for Mosaic. Called inside `backward`'s jitted function."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len, v_head_dim = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    bq, bkv = blocks.backward_block_q, blocks.backward_block_kv
    rows_compute = min(blocks.backward_block_kv_compute, bq)
    schedule = KvSchedule(spec, q_len, kv_len, bq, bkv)
    has_ids = segment_ids is not None
    wider = max(head_dim, v_head_dim)
    bias_dtype = None if bias is None else bias.dtype
    limit = vmem_limit_bytes(
        dq_kernel_vmem_bytes(bq, bkv, rows_compute, wider, q.dtype, has_ids, bias_dtype),
        f"backward block sizes backward_block_q={bq}, backward_block_kv={bkv} with "
        f"head_dim={head_dim}, v_head_dim={v_head_dim}, {q.dtype.name} (query gradient)",
        generation,
    )

    q_map, kv_map, row_map = query_grid_maps(schedule, group)

    in_specs = [
        pl.BlockSpec((None, None, bq, head_dim), q_map),
        pl.BlockSpec((None, None, bkv, head_dim), kv_map),
        pl.BlockSpec((None, None, bkv, v_head_dim), kv_map),
        pl.BlockSpec((None, None, bq, v_head_dim), q_map),
        pl.BlockSpec((None, None, 1, bq), row_map),
        pl.BlockSpec((None, None, 1, bq), row_map),
    ]
    args = [q, k, v, dout, lse, di]
    if has_ids:  # both as rows of lanes: free views of [batch, len]
        in_specs += [
            pl.BlockSpec((None, 1, bq), lambda b, h, i, j: (b, 0, i)),
            pl.BlockSpec((None, 1, bkv), lambda b, h, i, j: (b, 0, schedule.kv_block(i, j))),
        ]
        args += [segment_ids.q[:, None, :], segment_ids.kv[:, None, :]]
    if bias is not None:

        def bias_map(b, h, i, j):
            return *broadcast_block(bias.shape, b, h), i, schedule.kv_block(i, j)

        in_specs.append(pl.BlockSpec((None, None, bq, bkv), bias_map))
        args.append(bias)
    kernel = functools.partial(
        _kernel,
        spec=spec,
        schedule=schedule,
        rows_compute=rows_compute,
        segment_ids=has_ids,
        bias=bias is not None,
        precision=lax.Precision.HIGHEST if q.dtype == np.float32 else None,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(batch, q_heads, schedule.num_q_blocks, schedule.num_steps),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, bq, head_dim), q_map),
        scratch_shapes=[
            pltpu.VMEM((bq, head_dim), _F32),
            pltpu.VMEM((bq, LANES), _F32),
            pltpu.VMEM((bq, LANES), _F32),
            *([pltpu.VMEM((bq, LANES), jnp.int32)] if has_ids else []),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=limit,
        ),
        cost_estimate=_cost(q, k, v, schedule),
        interpret=False if interpret is None else interpret,
        name="pallas_flash_backward_dq",
    )(*args)
