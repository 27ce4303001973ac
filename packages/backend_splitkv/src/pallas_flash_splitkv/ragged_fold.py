"""The ragged kernel's online softmax (`ragged_kernel`): one kv block folded into a block of
query rows' running max, sum and accumulator (float32), and the rows' normalised output.

A row sees the positions up to its own (inside the window); in a *masked* block, positions
outside the item's range ``[lo, hi]`` (stale pages, unwritten slots) are masked. A stale NaN in
V would still poison ``p @ v`` (``0 x NaN``), so the V buffers hold no NaN: the kernel zeroes
them once before its first copy, and a masked block zeroes the rows past ``hi`` of ``hi``'s
page, `zero_stale_rows`: the only stale rows a copy brings (the rows before ``lo`` of
``lo``'s page are the sequence's own, written; a page before ``lo`` or after ``hi`` is not
copied, and its rows in the buffer are an earlier copy's, already clean).
An int8 block's V rows are never NaN; its V scales outside the range are zeroed instead. A
block every row sees whole (its positions from ``lo`` to the item's first token, every page
copied) is folded unmasked: no position mask, no rows zeroed. An int8 block is converted to
q's dtype and its scales applied to the scores (K) and to the probabilities (V).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash.masking import apply_softcap
from pallas_flash.specs import RaggedSpec

_F32 = jnp.float32
LANES = 128


class HeadRefs(NamedTuple):
    """One kv head's refs in a fold: its query rows ``q [rows, head_dim]``, its kv block
    ``views`` (k, v ``[block_kv, head_dim]`` and, for int8, their scales ``[block_kv]``), and
    its rows' running ``max`` and ``sum`` ``[rows, 128]`` and accumulator ``acc [rows,
    head_dim]``."""

    q: jax.Ref
    views: list[jax.Ref]
    max: jax.Ref
    sum: jax.Ref
    acc: jax.Ref


def fold_block(
    heads: Sequence[HeadRefs],
    q_pos: jax.Array,
    first: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    spec: RaggedSpec,
    masked: bool,
    page_size: int,
) -> None:
    """Folds one kv block at position ``first`` into the running max, sum and accumulator
    of each of ``heads``, stage by stage across them (every head's scores, then every head's
    softmax, then every head's ``p @ v``): the heads' dependent chains, each a matmul, a
    cross-lane max, an ``exp`` and a matmul, overlap in one basic block and take the MXUs in
    turn. ``q_pos [rows, 1]``: each row's position; ``[lo, hi]``: the positions any row sees;
    ``masked``: False for a block every row sees whole (module doc; then the positions are
    not read); ``page_size``: positions per page of the block."""
    dtype = heads[0].q.dtype
    precision = lax.Precision.HIGHEST if dtype == _F32 else None
    block_kv = heads[0].views[0].shape[0]
    int8 = len(heads[0].views) == 4
    if masked and not int8:  # first: off the scores' dependent chains
        for head in heads:
            zero_stale_rows(head.views[1], hi - first, page_size)
    scores = []  # [rows, block_kv] each
    for head in heads:
        k = head.views[0][...].astype(dtype)
        dims = (((1,), (1,)), ((), ()))
        s = lax.dot_general(head.q[...], k, dims, preferred_element_type=_F32, precision=precision)
        scores.append(s * head.views[2][...].reshape(1, block_kv) if int8 else s)
    scores = [apply_softcap(s * spec.sm_scale, spec.softcap) for s in scores]
    if masked:
        kv_pos = first + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        seen = (kv_pos >= lo) & (kv_pos <= hi)  # [1, block_kv]: held by a copied page
        visible = seen & (kv_pos <= q_pos)
        if spec.window is not None:
            visible = visible & (kv_pos >= q_pos - spec.window)
        scores = [jnp.where(visible, s, -jnp.inf) for s in scores]
    probabilities = []
    for s, head in zip(scores, heads, strict=True):
        m_prev = head.max[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row that has seen nothing yet
        p = jnp.exp(s - lanes(m_safe, block_kv))
        alpha = jnp.exp(m_prev - m_safe)
        head.max[...] = m_next
        head.sum[...] = alpha * head.sum[...] + jnp.sum(p, axis=1, keepdims=True)
        if int8:
            v_scales = head.views[3][...].reshape(1, block_kv)
            p = p * (jnp.where(seen, v_scales, 0.0) if masked else v_scales)
        probabilities.append((p, alpha))
    for (p, alpha), head in zip(probabilities, heads, strict=True):
        pv = lax.dot_general(
            p.astype(dtype), head.views[1][...].astype(dtype), (((1,), (0,)), ((), ())),
            preferred_element_type=_F32, precision=precision,
        )  # fmt: skip
        head.acc[...] = head.acc[...] * alpha[:, :1] + pv


def lanes(x: jax.Array, width: int) -> jax.Array:
    """``x [rows, 128]``, its lanes equal, as ``[rows, width]``: tiled where ``width`` is
    whole vregs of lanes (no permute across lanes), else broadcast from its first lane."""
    if width % LANES == 0:
        return jnp.tile(x, (1, width // LANES))
    return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def zero_stale_rows(v_ref: jax.Ref, last: jax.Array, page_size: int) -> None:
    """Zeroes the rows of ``v_ref [block_kv, head_dim]`` after row ``last`` (the range's last
    position) in its page: the page's stale slots, copied with it (module doc). Pages shorter
    than a sublane tile of ``v_ref``'s dtype are not aligned in VMEM: then the rows after
    ``last`` in the whole block are zeroed (those of later pages were never copied; zeroing
    them changes nothing that is read)."""
    block_kv = v_ref.shape[0]
    tile = 32 // jnp.dtype(v_ref.dtype).itemsize
    window = page_size if page_size % tile == 0 else block_kv

    @pl.when((last >= 0) & (last < block_kv - 1))
    def _zero() -> None:
        start = pl.multiple_of(lax.div(last, window) * window, window)  # last >= 0
        rows = v_ref[pl.ds(start, window)]
        row = start + lax.broadcasted_iota(jnp.int32, (window, 1), 0)
        v_ref[pl.ds(start, window)] = jnp.where(row <= last, rows, jnp.zeros((), rows.dtype))


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
