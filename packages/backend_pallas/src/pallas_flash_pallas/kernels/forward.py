"""The FlashAttention-2 forward kernel and the ``pallas_call`` around it.

Layouts: q ``[batch, q_heads, q_len, head_dim]``; k ``[batch, kv_heads, kv_len, head_dim]``;
v ``[batch, kv_heads, kv_len, v_head_dim]`` (``v_head_dim`` may differ: MLA's 128 beside
192); the output ``[batch, q_heads, q_len, v_head_dim]``; the log-sum-exp ``[batch, q_heads,
q_len]`` float32 (written by the kernel as lane-dense rows ``[batch, q_heads, 1, q_len]``); an
optional bias ``[batch or 1, q_heads or 1, q_len, kv_len]``, streamed by ``[block_q,
block_kv]`` block beside K and V (an axis of size 1 is broadcast by the index map, never
copied).

Grid ``(batch, q_heads, q blocks, kv steps)``: the first three axes are parallel, the kv axis
is sequential. One ``[block_q, head_dim]`` query block stays in VMEM while the kv blocks that
`schedule.KvSchedule` picks for it stream past (BlockSpec pipelining double-buffers them);
blocks that hold no visible key are neither fetched nor computed. Query head ``h`` reads kv
head ``h // (q_heads // kv_heads)`` through the K/V index maps, so GQA never repeats K/V in
HBM. Sequences need not be multiples of the blocks: the last block of each is partial; its
out-of-range rows hold garbage (even NaN), so out-of-range keys are masked and their V rows
zeroed, and out-of-range query rows are never written back.

Per visited block (online softmax, in float32): ``s = softcap(q k^T * sm_scale)`` plus the bias
block if there is one, masked to ``-inf`` where hidden; ``m' = max(m, rowmax(s))``; ``p = exp(s -
m')``; ``l' = l exp(m - m') + rowsum(p)``; ``acc' = acc exp(m - m') + p v``; the first visited block
writes ``m = rowmax(s)``, ``l = rowsum(p)``, ``acc = p v`` instead, so nothing is zero-initialised
(except for a query block that sees no key at all). After the last step the output is ``acc / l``
and the log-sum-exp ``m + log(l)``; a row that saw no key gives zeros and a log-sum-exp of ``-inf``.
With sinks, the head's sink joins the sum then: ``m* = max(m, sink)``, ``l* = l exp(m - m*) +
exp(sink - m*)``, the output ``acc exp(m - m*) / l*`` and the log-sum-exp ``m* + log(l*)``, which
the backward reads unchanged. The kernel keeps ``s`` and ``m`` in base-2 units (``s log2(e)``, the
scale and ``log2(e)`` in one multiply) and takes ``exp2``, as splash's ``use_base2_exp``: one
multiply a score fewer than ``exp`` (16 heads of N=1024 without a mask: 0.0509 ms to 0.0486 ms on
v5e, static estimate); the log-sum-exp it writes is in natural units. The block is folded in tiles,
in straight-line code, so the compiler overlaps the matmuls of one tile with the softmax of another:
a block that no mask crosses in ``full_block_compute`` rows by as many keys
(`block_sizes.full_block_tiles`), others in row sub-blocks of ``block_q_compute`` rows by all the
keys. Only blocks that cross a mask boundary build a mask (`schedule.BlockKind`); on the causal
diagonal each row sub-block stops at its last row's key and masks only its square tile on the
diagonal.
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
from pallas_flash.masking import apply_softcap, positional_mask
from pallas_flash.specs import AttentionSpec, SegmentIds
from pallas_flash_pallas.blocks.block_sizes import (
    LANES,
    BlockSizes,
    forward_vmem_bytes,
    full_block_tiles,
    vmem_limit_bytes,
)
from pallas_flash_pallas.blocks.schedule import BlockKind, KvSchedule
from pallas_flash_pallas.kernels.kernel_helpers import (
    NN,
    NT,
    both,
    broadcast_block,
    lanes,
    mask_diagonal_tile,
    query_grid_maps,
    when,
)

_F32 = jnp.float32
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
"""The scores are kept in base-2 units (``s log2(e)``: one multiply with the scale) so that
the softmax's exponentials are ``exp2``, as splash's ``use_base2_exp``."""


def _kernel(
    *refs: jax.Ref,
    spec: AttentionSpec,
    schedule: KvSchedule,
    block_q_compute: int,
    full_block_compute: int,
    segment_ids: bool,
    bias: bool,
    sinks: bool,
    with_lse: bool,
    precision: lax.Precision | None,
) -> None:
    """One grid step ``(b, h, i, j)``: folds kv block ``schedule.kv_block(i, j)`` into the
    running max, sum and accumulator of query block ``i``; writes the output at the last step.

    Refs: inputs q ``[block_q, head_dim]``, k ``[block_kv, head_dim]`` and v ``[block_kv,
    v_head_dim]``, with segment ids
    those of the queries ``[1, block_q]`` and of the keys ``[1, block_kv]``, with a bias its
    ``[block_q, block_kv]`` block, with sinks the head's sink in every lane ``[1, 128]``
    float32; outputs
    ``[block_q, v_head_dim]`` and, ``with_lse``, log-sum-exp ``[1, block_q]``; scratch: running
    max and sum ``[block_q, 128]`` (equal lanes) and accumulator ``[block_q, v_head_dim]``, all
    float32, and with segment ids the queries' ids as equal-lane columns ``[block_q, 128]``
    int32.
    """
    num_inputs = 3 + 2 * segment_ids + bias + sinks
    q_ref, k_ref, v_ref, *id_refs = refs[:num_inputs]
    sink_ref = id_refs.pop() if sinks else None
    bias_ref = id_refs.pop() if bias else None
    o_ref, *refs = refs[num_inputs:]
    lse_ref = refs.pop(0) if with_lse else None
    m_ref, l_ref, acc_ref, *id_scratch = refs
    q_ids_ref, kv_ids_ref = id_refs or (None, None)
    ids_ref = id_scratch[0] if id_scratch else None
    i, j = pl.program_id(2), pl.program_id(3)
    block_q, block_kv = schedule.block_q, schedule.block_kv
    v_head_dim = acc_ref.shape[1]
    kv_block = schedule.kv_block(i, j)

    if segment_ids:

        @pl.when(j == 0)
        def _start() -> None:  # the queries' ids, a row of lanes, as equal-lane columns
            ids_ref[...] = jnp.broadcast_to(q_ids_ref[...], (LANES, block_q)).T

    if not schedule.visits_every_step:  # a block that sees no key is never folded into

        @pl.when((j == 0) & (schedule.count(i) == 0))
        def _start_unseen() -> None:
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
            l_ref[...] = jnp.zeros(l_ref.shape, _F32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

    def fold_tile(
        first_row: int, num_rows: int, first_key: int, num_keys: int, kind: BlockKind, first: bool
    ) -> None:
        """Folds keys ``first_key ...`` of the kv block into rows ``first_row ...`` of the
        query block, masked by the causal, window and key-range rules unless ``kind`` is FULL;
        on the DIAGONAL (from key 0) only the keys up to the last row, masked in the diagonal
        tile only. The ``first`` tile of a row's first block writes the running max, sum and
        accumulator instead of updating them."""
        if kind == BlockKind.DIAGONAL:  # relative row r sees relative keys <= r only
            num_keys = min(num_keys, first_row + num_rows)
        rows, keys = pl.ds(first_row, num_rows), pl.ds(first_key, num_keys)
        v = v_ref[keys, :]
        s = lax.dot_general(
            q_ref[rows, :], k_ref[keys, :], NT, preferred_element_type=_F32, precision=precision
        )  # [num_rows, num_keys]
        if spec.softcap is None and not bias:  # one multiply: the scale and log2(e)
            s = s * (spec.sm_scale * LOG2_E)
        else:
            s = apply_softcap(s * spec.sm_scale, spec.softcap)
            if bias:
                s = s + bias_ref[rows, keys].astype(_F32)
            s = s * LOG2_E
        visible = None
        if kind == BlockKind.MASKED:
            key_pos = kv_block * block_kv + first_key
            q_pos = i * block_q + first_row + lax.broadcasted_iota(jnp.int32, s.shape, 0)
            kv_pos = key_pos + lax.broadcasted_iota(jnp.int32, s.shape, 1)
            visible = positional_mask(q_pos, kv_pos, spec)
            if schedule.kv_len % block_kv:  # the last kv block is partial: hide its tail
                visible = both(visible, kv_pos < schedule.kv_len)
                v_pos = key_pos + lax.broadcasted_iota(jnp.int32, v.shape, 0)
                v = jnp.where(v_pos < schedule.kv_len, v, jnp.zeros_like(v))
        if segment_ids:
            visible = both(visible, lanes(ids_ref[rows, :], num_keys) == kv_ids_ref[:, keys])
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
        if kind == BlockKind.DIAGONAL and first_row < block_kv:
            s = mask_diagonal_tile(s, first_row, keys_on_rows=False, fill=-jnp.inf)
        m_next = jnp.max(s, axis=1, keepdims=True)
        if first:
            m_next = jnp.broadcast_to(m_next, (num_rows, LANES))
        else:
            m_prev = m_ref[rows, :]
            m_next = jnp.maximum(m_prev, m_next)
        m_shift = m_next
        if visible is not None or bias:  # a row that has seen no key yet has max -inf: shift by 0
            m_shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        p = jnp.exp2(s - lanes(m_shift, num_keys))
        m_ref[rows, :] = m_next
        total = jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(
            p.astype(v.dtype), v, NN, preferred_element_type=_F32, precision=precision
        )
        if first:
            l_ref[rows, :] = jnp.broadcast_to(total, (num_rows, LANES))
            acc_ref[rows, :] = pv
        else:
            alpha = jnp.exp2(m_prev - m_shift)
            l_ref[rows, :] = alpha * l_ref[rows, :] + total
            acc_ref[rows, :] = acc_ref[rows, :] * lanes(alpha, v_head_dim) + pv

    def fold(kind: BlockKind, first: bool) -> None:
        """Folds the kv block in, one tile after another (unrolled): tiles of different rows
        are independent, so the compiler overlaps one tile's matmuls with another's softmax.
        A FULL block in the tiles of `full_block_tiles`, others in ``block_q_compute`` rows by
        all keys."""
        if kind == BlockKind.FULL:
            tiles = full_block_tiles(block_q, block_kv, full_block_compute)
        else:
            tiles = [
                (first_row, min(block_q_compute, block_q - first_row), 0, block_kv)
                for first_row in range(0, block_q, block_q_compute)
            ]
        for first_row, num_rows, first_key, num_keys in tiles:
            fold_tile(first_row, num_rows, first_key, num_keys, kind, first and first_key == 0)

    visited = True if schedule.visits_every_step else schedule.is_visited(i, j)
    for first, kinds in ((True, schedule.step_kinds(first=True)), (False, schedule.step_kinds())):
        step = (j == 0) if first else (j > 0)
        if len(kinds) == 1:
            (kind,) = kinds
            when(visited & step, functools.partial(fold, kind, first))
        elif kinds:
            kind = schedule.kind(i, kv_block)
            for each in sorted(kinds):
                when(visited & step & (kind == each), functools.partial(fold, each, first))

    @pl.when(j == schedule.num_steps - 1)
    def _finish() -> None:
        total, row_max = l_ref[...], m_ref[...]
        rescale = None
        if sinks:  # the sink joins the sum: rescale it and the accumulator to max(m, sink)
            sink = sink_ref[...] * LOG2_E  # [1, 128], in the scores' base-2 units
            joint = jnp.maximum(row_max, sink)
            joint = jnp.where(joint == -jnp.inf, 0.0, joint)
            rescale = jnp.exp2(row_max - joint)  # 0 for a row that saw no key
            total, row_max = total * rescale + jnp.exp2(sink - joint), joint
        seen = total > 0.0  # the sum is >= 1 once a row has seen a key (or has a sink)
        inverse = jnp.where(seen, pl.reciprocal(total, full_range=False), 0.0)
        if rescale is not None:
            inverse = inverse * rescale
        o_ref[...] = (acc_ref[...] * lanes(inverse, v_head_dim)).astype(o_ref.dtype)
        if with_lse:  # in rows of lanes: transposing first needs 128x fewer logs
            total_row, max_row = total.T[:1], row_max.T[:1]  # [1, block_q]
            lse = (max_row + jnp.log2(total_row)) * LN_2  # back to natural units
            lse_ref[...] = jnp.where(total_row > 0.0, lse, -jnp.inf)


def _cost(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    schedule: KvSchedule,
    segment_ids: bool,
    bias: jax.Array | None,
) -> pl.CostEstimate:
    """Flops and exponentials of the visited blocks; bytes moved between HBM and VMEM (q and
    the output once, a K and a V block and a bias block per visited block)."""
    batch, q_heads, _, head_dim = q.shape
    v_head_dim = v.shape[3]
    blocks = batch * q_heads * schedule.visited_blocks
    pairs = blocks * schedule.block_q * schedule.block_kv
    kv_bytes = blocks * schedule.block_kv * (head_dim + v_head_dim) * k.dtype.itemsize
    out_bytes = q.nbytes // head_dim * v_head_dim
    bytes_accessed = q.nbytes + out_bytes + kv_bytes + 4 * batch * q_heads * schedule.q_len
    if segment_ids:
        bytes_accessed += 4 * batch * (schedule.q_len + q_heads * schedule.visited_blocks)
    if bias is not None:
        bias_block = schedule.block_q * schedule.block_kv * bias.dtype.itemsize
        bytes_accessed += blocks * bias_block
    return pl.CostEstimate(
        flops=2 * pairs * (head_dim + v_head_dim),
        transcendentals=pairs,
        bytes_accessed=bytes_accessed,
    )


def flash_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: SegmentIds | None = None,
    sinks: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    spec: AttentionSpec,
    block_sizes: BlockSizes | None = None,
    devices: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Attention output and log-sum-exp of validated inputs.

    Runs the kernel as Mosaic or in the TPU interpreter as `interpret.interpret_params`
    decides (at trace time).

    Args:
      q: ``[batch, q_heads, q_len, head_dim]``, bfloat16 or float32.
      k: ``[batch, kv_heads, kv_len, head_dim]``, dtype of q; ``q_heads % kv_heads == 0``.
      v: ``[batch, kv_heads, kv_len, v_head_dim]``, dtype of q.
      segment_ids: int32 ``q [batch, q_len]`` and ``kv [batch, kv_len]``, or None.
      sinks: ``[q_heads]`` float, a logit per query head in every row's denominator, or None.
      bias: ``[batch or 1, q_heads or 1, q_len, kv_len]`` float, added to the scores (after
        the softcap), or None.
      spec: the call's settings.
      block_sizes: block sizes (None sizes: the defaults of the TPU generation,
        `block_sizes.default_block_sizes`), before clamping to the sequence lengths; default
        `BlockSizes()`.
      devices: how many devices run the kernel at once (inside ``shard_map``), for the
        interpreter (`interpret.jit_kernel`).

    Returns:
      ``(out, lse)``: ``out [batch, q_heads, q_len, v_head_dim]`` in q's dtype and
      ``lse [batch, q_heads, 1, q_len]`` float32 (rows of lanes, the layout the backward
      reads), the log of each row's softmax denominator (``max + log(sum exp(s - max))``,
      the sink's term included); a row that sees no key has output 0 and log-sum-exp
      ``-inf`` (its sink's, with sinks).

    Raises:
      ValueError: the block sizes are illegal for these lengths or do not fit in VMEM.
    """
    block_sizes = BlockSizes() if block_sizes is None else block_sizes
    return _forward(
        q,
        k,
        v,
        segment_ids,
        _sink_lanes(sinks, q),
        bias,
        spec=spec,
        block_sizes=block_sizes,
        with_lse=True,
        generation=tpu.current_generation(),
        devices=devices,
    )


def flash_output(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: SegmentIds | None = None,
    sinks: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    spec: AttentionSpec,
    block_sizes: BlockSizes | None = None,
) -> jax.Array:
    """The output of `flash_forward` alone: the kernel then neither computes nor writes the
    log-sum-exp (for calls that are not differentiated)."""
    block_sizes = BlockSizes() if block_sizes is None else block_sizes
    (out,) = _forward(
        q,
        k,
        v,
        segment_ids,
        _sink_lanes(sinks, q),
        bias,
        spec=spec,
        block_sizes=block_sizes,
        with_lse=False,
        generation=tpu.current_generation(),
    )
    return out


def _sink_lanes(sinks: jax.Array | None, q: jax.Array) -> jax.Array | None:
    """``[batch, q_heads, 1, 128]`` float32: each head's sink in every lane of a row, led by
    the batch axis as every kernel argument is (`interpret.jit_kernel`); or None."""
    if sinks is None:
        return None
    batch, q_heads = q.shape[:2]
    return jnp.broadcast_to(sinks.astype(_F32)[None, :, None, None], (batch, q_heads, 1, LANES))


def _flash_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: SegmentIds | None,
    sink_lanes: jax.Array | None,
    bias: jax.Array | None,
    *,
    spec: AttentionSpec,
    block_sizes: BlockSizes,
    with_lse: bool,
    generation: tpu.TpuGeneration,
    interpret: pltpu.InterpretParams | None,
) -> tuple[jax.Array, ...]:
    """``(out, lse)`` of `flash_forward`, or ``(out,)`` without ``with_lse``, built for
    ``generation``; ``interpret``: the interpreter's settings, or None for Mosaic."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len, v_head_dim = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    blocks = block_sizes.for_call(
        spec, q_len, kv_len, generation, bias=bias is not None, dtype=q.dtype
    )
    schedule = KvSchedule(spec, q_len, kv_len, blocks.block_q, blocks.block_kv)
    has_ids = segment_ids is not None
    bias_dtype = None if bias is None else bias.dtype
    limit = vmem_limit_bytes(  # every block at the wider head_dim: an upper bound
        forward_vmem_bytes(blocks, max(head_dim, v_head_dim), q.dtype, has_ids, bias_dtype),
        f"forward block sizes block_q={blocks.block_q}, block_kv={blocks.block_kv} with "
        f"head_dim={head_dim}, v_head_dim={v_head_dim}, {q.dtype.name}",
        generation,
    )

    q_map, kv_map, lse_map = query_grid_maps(schedule, group)

    def q_ids_map(b, h, i, j):
        return b, 0, i

    def kv_ids_map(b, h, i, j):
        return b, 0, schedule.kv_block(i, j)

    q_spec = pl.BlockSpec((None, None, blocks.block_q, head_dim), q_map)
    k_spec = pl.BlockSpec((None, None, blocks.block_kv, head_dim), kv_map)
    v_spec = pl.BlockSpec((None, None, blocks.block_kv, v_head_dim), kv_map)
    out_spec = pl.BlockSpec((None, None, blocks.block_q, v_head_dim), q_map)
    in_specs = [q_spec, k_spec, v_spec]
    args = [q, k, v]
    if has_ids:  # both as rows of lanes: free views of [batch, len]
        in_specs += [
            pl.BlockSpec((None, 1, blocks.block_q), q_ids_map),
            pl.BlockSpec((None, 1, blocks.block_kv), kv_ids_map),
        ]
        args += [segment_ids.q[:, None, :], segment_ids.kv[:, None, :]]
    if bias is not None:

        def bias_map(b, h, i, j):
            return *broadcast_block(bias.shape, b, h), i, schedule.kv_block(i, j)

        in_specs.append(pl.BlockSpec((None, None, blocks.block_q, blocks.block_kv), bias_map))
        args.append(bias)
    if sink_lanes is not None:
        in_specs.append(pl.BlockSpec((None, None, 1, LANES), lambda b, h, i, j: (b, h, 0, 0)))
        args.append(sink_lanes)
    precision = lax.Precision.HIGHEST if q.dtype == np.float32 else None
    kernel = functools.partial(
        _kernel,
        spec=spec,
        schedule=schedule,
        block_q_compute=blocks.block_q_compute,
        full_block_compute=blocks.full_block_compute,
        segment_ids=has_ids,
        bias=bias is not None,
        sinks=sink_lanes is not None,
        with_lse=with_lse,
        precision=precision,
    )
    out_shape = [jax.ShapeDtypeStruct((batch, q_heads, q_len, v_head_dim), q.dtype)]
    out_specs = [out_spec]
    if with_lse:  # lane-dense rows
        out_shape.append(jax.ShapeDtypeStruct((batch, q_heads, 1, q_len), _F32))
        out_specs.append(pl.BlockSpec((None, None, 1, blocks.block_q), lse_map))
    return pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(batch, q_heads, schedule.num_q_blocks, schedule.num_steps),
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        scratch_shapes=[
            pltpu.VMEM((blocks.block_q, LANES), _F32),
            pltpu.VMEM((blocks.block_q, LANES), _F32),
            pltpu.VMEM((blocks.block_q, v_head_dim), _F32),
            *([pltpu.VMEM((blocks.block_q, LANES), jnp.int32)] if has_ids else []),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=limit,
        ),
        cost_estimate=_cost(q, k, v, schedule, has_ids, bias),
        interpret=False if interpret is None else interpret,
        name="pallas_flash_forward",
    )(*args)


_forward = interpret.jit_kernel(_flash_forward, ("spec", "block_sizes", "with_lse", "generation"))
