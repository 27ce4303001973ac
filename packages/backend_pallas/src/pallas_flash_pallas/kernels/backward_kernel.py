"""The FlashAttention-2 backward kernel's body: dq, dk and dv of the pairs of blocks one grid
step visits (its grid, layouts and chunks: `backward`).

Per visited pair, in the keys-as-rows orientation so that the log-sum-exp and ``di`` rows
broadcast along sublanes and dk, dv accumulate row-wise (float32 throughout):
``s^T = softcap(k q^T * sm_scale)``, ``p^T = exp(s^T - lse)`` (zero where hidden),
``dv += p^T dout``, ``dp^T = v dout^T``, ``ds^T = p^T (dp^T - di)`` times the softcap's
derivative ``1 - (s / softcap)^2``, ``dk += ds^T q`` and ``dq += ds k``. A bias ``[batch or 1,
q_heads or 1, q_len, kv_len]`` joins ``s^T`` after the softcap, each tile transposed in VMEM
(never a transposed copy in HBM); its gradient, when asked for, is ``ds`` before the softcap's
derivative, written by block pair (transposed back in VMEM) into a float32 ``[batch, q_heads,
q_len, kv_len]`` (`backward.bias_gradient` sums it to the bias's shape). dq and dk are scaled
by ``sm_scale`` once, at the end. That is five matmuls per pair, the least FlashAttention-2
needs (split dq and dk/dv kernels recompute ``s`` and ``dp`` in both: seven).

Partial last blocks hold garbage rows (even NaN): out-of-range query rows and their output
gradients, and out-of-range keys, are zeroed before the matmuls that sum over them, and the
probabilities and their gradients are masked. A pair on the causal diagonal computes, for each
key sub-block, only the query rows at or below its first key, and masks only the square tile
of those rows on the diagonal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash.masking import apply_softcap, positional_mask
from pallas_flash.specs import AttentionSpec
from pallas_flash_pallas.blocks.block_sizes import LANES
from pallas_flash_pallas.blocks.schedule import BlockKind, QSchedule
from pallas_flash_pallas.kernels.kernel_helpers import (
    NN,
    NT,
    TN,
    both,
    lanes,
    mask_diagonal_tile,
    recomputed_probabilities,
    when,
    zero_rows_from,
)

_F32 = jnp.float32


def head_and_step(t: jax.Array, steps: int) -> tuple[jax.Array, jax.Array]:
    """Step ``t`` of the grid's last axis as ``(query head within the group, step of that
    head's schedule)``: each head of the group takes ``steps`` consecutive steps."""
    return lax.div(t, jnp.int32(steps)), lax.rem(t, jnp.int32(steps))


def _transposed(tile: jax.Array) -> jax.Array:
    """``tile [m, n]`` (a bias's) transposed in VMEM, as float32.

    Mosaic (libtpu 0.0.42) fails a RET_CHECK in its MXU-result pass when a float32 transpose
    feeds the scores, so a float32 tile is split into three bfloat16 parts, ``x = a + b + c``
    exactly (8 significant bits each; infinities in ``a`` alone), each transposed and summed
    back ``a + (b + c)``; a bfloat16 tile transposes and converts."""
    if tile.dtype != jnp.float32:
        return tile.T.astype(_F32)
    parts, rest = [], tile
    for _ in range(3):
        part = rest.astype(jnp.bfloat16)
        parts.append(part)
        rest = jnp.where(jnp.isfinite(rest), rest - part.astype(_F32), 0.0)
    a, b, c = (part.T.astype(_F32) for part in parts)
    return a + (b + c)


def backward_kernel(
    *refs: jax.Ref,
    spec: AttentionSpec,
    schedule: QSchedule,
    group: int,
    block_kv_compute: int,
    dq_rows: int,
    segment_ids: bool,
    bias: bool,
    with_bias_gradient: bool,
    with_dq: bool,
    precision: lax.Precision | None,
) -> None:
    """One grid step ``(b, kv head, c, j, t)``: folds query block
    ``schedule.q_block(c, j, t % steps)`` of query head ``t // steps`` of the group into the
    gradients of kv block ``j``; writes dk, dv after the block's last step and dq after the
    chunk's last step.

    Refs: inputs q ``[block_q, head_dim]``, k ``[block_kv, head_dim]``, v ``[block_kv,
    v_head_dim]``, dout ``[block_q, v_head_dim]``, log-sum-exp and row sums ``[1, block_q]``,
    with segment ids those of the queries ``[1, block_q]`` and of the keys ``[1, block_kv]``,
    with a bias its block ``[block_q, block_kv]``; outputs dq ``[group, rows, head_dim]`` (the
    chunk's rows of the group's heads), dk ``[block_kv, head_dim]``, dv ``[block_kv,
    v_head_dim]`` and with ``with_bias_gradient`` the bias's ``[block_q, block_kv]`` float32;
    scratch: the query gradient
    ``[group * dq_rows, head_dim]``, dk and dv, all float32, and with segment ids the keys'
    ids as equal-lane columns ``[block_kv, 128]``. Without ``with_dq`` (`backward_dq` computes
    dq) there is neither dq output nor its scratch.
    """
    num_inputs = 6 + 2 * segment_ids + bias
    q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *id_refs = refs[:num_inputs]
    bias_ref = id_refs.pop() if bias else None
    refs = list(refs[num_inputs:])
    dq_out = refs.pop(0) if with_dq else None
    dk_out, dv_out = refs.pop(0), refs.pop(0)
    dbias_out = refs.pop(0) if with_bias_gradient else None
    dq_acc = refs.pop(0) if with_dq else None
    dk_acc, dv_acc, *id_scratch = refs
    q_ids_ref, kv_ids_ref = id_refs or (None, None)
    ids_ref = id_scratch[0] if id_scratch else None
    c, j, t = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    steps = schedule.num_steps
    g, s = head_and_step(t, steps)
    block_q, block_kv = schedule.block_q, schedule.block_kv
    q_block = schedule.q_block(c, j, s)
    local_block = q_block - c * schedule.blocks_per_chunk
    dq_base = pl.multiple_of(g * dq_rows + local_block * block_q, 8)

    if with_dq:

        @pl.when((j == 0) & (t == 0))
        def _start_chunk() -> None:
            dq_acc[...] = jnp.zeros(dq_acc.shape, _F32)

    @pl.when(t == 0)
    def _start_kv_block() -> None:
        dk_acc[...] = jnp.zeros(dk_acc.shape, _F32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, _F32)
        if segment_ids:  # the keys' ids, a row of lanes, turned into equal-lane columns
            ids_ref[...] = jnp.broadcast_to(kv_ids_ref[...], (LANES, block_kv)).T

    partial_q = schedule.q_len % block_q != 0
    partial_kv = schedule.kv_len % block_kv != 0

    def fold_keys(first_key: int, num_keys: int, kind: BlockKind) -> None:
        """Folds the query block's rows into keys ``first_key ..`` of the kv block: all rows,
        masked by the causal, window and range rules unless ``kind`` is FULL; on the DIAGONAL
        only the rows from ``first_key`` on, masked in the diagonal tile only."""
        first_row = first_key if kind == BlockKind.DIAGONAL else 0
        masked = kind == BlockKind.MASKED
        keys, rows = pl.ds(first_key, num_keys), pl.ds(first_row, block_q - first_row)
        k, v, q, do = k_ref[keys, :], v_ref[keys, :], q_ref[rows, :], do_ref[rows, :]
        key_pos = j * block_kv + first_key
        row_pos = q_block * block_q + first_row
        if masked and partial_kv:  # dq sums over keys: garbage keys must be zeros
            k = zero_rows_from(k, key_pos, schedule.kv_len)
        if masked and partial_q:  # dk and dv sum over rows: garbage rows must be zeros
            q = zero_rows_from(q, row_pos, schedule.q_len)
            do = zero_rows_from(do, row_pos, schedule.q_len)
        s_t = lax.dot_general(k, q, NT, preferred_element_type=_F32, precision=precision)
        s_t = apply_softcap(s_t * spec.sm_scale, spec.softcap)  # [num_keys, num_rows]
        visible = None
        if masked:
            kv_pos = key_pos + lax.broadcasted_iota(jnp.int32, s_t.shape, 0)
            q_row = row_pos + lax.broadcasted_iota(jnp.int32, s_t.shape, 1)
            visible = positional_mask(q_row, kv_pos, spec)
            if partial_kv:
                visible = both(visible, kv_pos < schedule.kv_len)
            if partial_q:
                visible = both(visible, q_row < schedule.q_len)
        if segment_ids:
            ids = lanes(ids_ref[keys, :], block_q - first_row) == q_ids_ref[:, rows]
            visible = both(visible, ids)
        logits = s_t + _transposed(bias_ref[rows, keys]) if bias else s_t
        p_t = recomputed_probabilities(logits, lse_ref[:, rows], visible, bias)
        if kind == BlockKind.DIAGONAL:
            p_t = mask_diagonal_tile(p_t, 0, keys_on_rows=True, fill=0.0)
        dv_acc[keys, :] += lax.dot_general(
            p_t.astype(do.dtype), do, NN, preferred_element_type=_F32, precision=precision
        )
        dp_t = lax.dot_general(v, do, NT, preferred_element_type=_F32, precision=precision)
        ds_t = p_t * (dp_t - di_ref[:, rows])
        if visible is not None and (partial_q or partial_kv):  # garbage v or di: 0 * NaN
            ds_t = jnp.where(visible, ds_t, 0.0)
        if with_bias_gradient:
            dbias_out[rows, keys] = ds_t.T
        if spec.softcap is not None:
            ds_t = ds_t * (1.0 - jnp.square(s_t * (1.0 / spec.softcap)))
        ds_t = ds_t.astype(q.dtype)
        dk_acc[keys, :] += lax.dot_general(
            ds_t, q, NN, preferred_element_type=_F32, precision=precision
        )
        if with_dq:
            dq_slice = pl.ds(dq_base + first_row, block_q - first_row)
            dq_acc[dq_slice, :] += lax.dot_general(
                ds_t, k, TN, preferred_element_type=_F32, precision=precision
            )

    def fold(kind: BlockKind) -> None:
        """Folds the query block in, one key sub-block after another (unrolled)."""
        for first_key in range(0, block_kv, block_kv_compute):
            if kind == BlockKind.DIAGONAL and first_key >= block_q:
                break  # relative key c is seen by relative rows >= c only
            fold_keys(first_key, min(block_kv_compute, block_kv - first_key), kind)

    visited = schedule.is_visited(c, j, s)
    kinds = schedule.kinds
    if len(kinds) == 1:
        (kind,) = kinds
        when(visited, functools.partial(fold, kind))
    elif kinds:
        kind = schedule.kind(q_block, j)
        for each in sorted(kinds):
            when(visited & (kind == each), functools.partial(fold, each))

    @pl.when(t == group * steps - 1)
    def _finish_kv_block() -> None:
        dk_out[...] = (dk_acc[...] * spec.sm_scale).astype(dk_out.dtype)
        dv_out[...] = dv_acc[...].astype(dv_out.dtype)

    if with_dq:

        @pl.when((j == schedule.num_kv_blocks - 1) & (t == group * steps - 1))
        def _finish_chunk() -> None:
            rows = dq_out.shape[1]
            for head in range(group):
                chunk = dq_acc[pl.ds(head * dq_rows, rows), :]
                dq_out[head] = (chunk * spec.sm_scale).astype(dq_out.dtype)
