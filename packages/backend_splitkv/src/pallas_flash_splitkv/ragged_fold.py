"""The ragged kernel's online softmax (`ragged_kernel`): one kv block folded into a block of
query rows' running max, sum and accumulator (float32), and the rows' normalised output.

A row sees the positions up to its own (inside the window); in a *masked* block, positions
outside the item's range ``[lo, hi]`` (stale pages, unwritten slots) are masked and their V
rows (int8: V scales) zeroed, since a stale NaN would poison ``p @ v``. A block every row sees
whole (its positions from ``lo`` to the item's first token, every page copied) is folded
unmasked: no position mask, no V rows zeroed. An int8 block is converted to q's dtype and its
scales applied to the scores (K) and to the probabilities (V).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash.masking import apply_softcap
from pallas_flash.specs import RaggedSpec

_F32 = jnp.float32


def fold_block(
    q_ref: jax.Ref,
    views: list[jax.Ref],
    m_ref: jax.Ref,
    l_ref: jax.Ref,
    acc_ref: jax.Ref,
    q_pos: jax.Array,
    first: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    spec: RaggedSpec,
    masked: bool,
) -> None:
    """Folds one kv block (``views``: k, v ``[block_kv, head_dim]`` and, for int8, their
    scales ``[block_kv]``) at position ``first`` into the running max and sum ``[rows, 128]``
    and accumulator ``[rows, head_dim]`` of the query rows ``q_ref [rows, head_dim]``.
    ``q_pos [rows, 1]``: each row's position; ``[lo, hi]``: the positions any row sees;
    ``masked``: False for a block every row sees whole (module doc; then the positions are
    not read)."""
    q = q_ref[...]
    dtype = q.dtype
    precision = lax.Precision.HIGHEST if dtype == _F32 else None
    k_view, v_view = views[0], views[1]
    block_kv = k_view.shape[0]
    k = k_view[...].astype(dtype)
    scores = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=_F32, precision=precision
    )  # [rows, block_kv]
    if len(views) == 4:
        scores = scores * views[2][...].reshape(1, block_kv)
    scores = apply_softcap(scores * spec.sm_scale, spec.softcap)
    if masked:
        kv_pos = first + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        seen = (kv_pos >= lo) & (kv_pos <= hi)  # [1, block_kv]: held by a copied page
        visible = seen & (kv_pos <= q_pos)
        if spec.window is not None:
            visible = visible & (kv_pos >= q_pos - spec.window)
        scores = jnp.where(visible, scores, -jnp.inf)
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row that has seen nothing yet
    p = jnp.exp(scores - m_safe[:, :1])
    alpha = jnp.exp(m_prev - m_safe)
    m_ref[...] = m_next
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    if len(views) == 4:
        v_scales = views[3][...].reshape(1, block_kv)
        p = p * (jnp.where(seen, v_scales, 0.0) if masked else v_scales)
        v = v_view[...].astype(dtype)
    elif not masked:
        v = v_view[...].astype(dtype)
    else:
        # rows lo - first to hi - first, compared as unsigned: one compare a row
        row = lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0) - (lo - first)
        span = jnp.maximum(hi - lo + 1, 0)
        seen_rows = row.astype(jnp.uint32) < span.astype(jnp.uint32)
        v = jnp.where(seen_rows, v_view[...], jnp.zeros((), v_view.dtype)).astype(dtype)
    pv = lax.dot_general(
        p.astype(dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=_F32,
        precision=precision,
    )  # fmt: skip
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv


def finish_rows(
    sinks_ref: jax.Ref | None, m_ref: jax.Ref, l_ref: jax.Ref, acc_ref: jax.Ref
) -> jax.Array:
    """The normalised output ``[rows, head_dim]`` in float32, each row's sink (if any) in its
    denominator; a row that saw nothing gives zeros."""
    m, total, acc = m_ref[...][:, :1], l_ref[...][:, :1], acc_ref[...]
    if sinks_ref is not None:
        sink = sinks_ref[...][:, :1]
        m_final = jnp.maximum(m, sink)
        rescale = jnp.exp(m - m_final)
        total = total * rescale + jnp.exp(sink - m_final)
        acc = acc * rescale
    inverse = jnp.where(total > 0.0, 1.0 / jnp.where(total > 0.0, total, 1.0), 0.0)
    return acc * inverse
