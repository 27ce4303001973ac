"""The ragged kernel's online softmax (`ragged_kernel`): one kv block folded into a block of
query rows' running max, sum and accumulator (float32), and the rows' normalised output.

A row sees the positions up to its own (inside the window); in a *masked* block, positions
outside the item's range ``[lo, hi]`` (stale pages, unwritten slots) are masked. A stale NaN in
V would still poison ``p @ v`` (``0 x NaN``), so the V buffers hold no NaN: the kernel zeroes
them once before its first copy, and a masked block zeroes the rows past ``hi`` of ``hi``'s
page, `zero_stale_rows`: the only stale rows a copy brings (the rows before ``lo`` of
``lo``'s page are the sequence's own, written; a page before ``lo`` or after ``hi`` is not
copied, and its rows in the buffer are an earlier copy's, already clean).
A packed block (`pallas_flash.kv_packing`) is unpacked once per fold; it is copied exactly (its
positions in ``[lo, hi]``, the new ones from the batch, `ragged_copies`), so its other rows are
an earlier copy's or the zeros it started with: none to zero. An int8 block's V rows are
never NaN; its V scales outside the range are zeroed instead. A
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

from pallas_flash.kv_packing import unpack_kv
from pallas_flash.masking import apply_softcap
from pallas_flash.specs import RaggedSpec
from pallas_flash_splitkv.blocks import LANES

_F32 = jnp.float32


class HeadRefs(NamedTuple):
    """One kv head's refs in a fold: its query rows ``q [rows, head_dim]``, the kv block of
    each sequence of the item (`BlockSpan`), ``views[e]``: k, v ``[block_kv, head_dim]`` and,
    for int8, their scales ``[block_kv]``, or a packed block's words ``uint32 [block_kv,
    head_dim]`` alone; and its rows' running ``max`` and ``sum`` ``[rows, 128]`` and
    accumulator ``acc [rows, head_dim]``."""

    q: jax.Ref
    views: Sequence[Sequence[jax.Ref]]
    max: jax.Ref
    sum: jax.Ref
    acc: jax.Ref


class BlockSpan(NamedTuple):
    """Where one sequence's kv block lies: its first position ``first``, and the positions
    ``[lo, hi]`` some row of that sequence sees."""

    first: jax.Array
    lo: jax.Array
    hi: jax.Array


def fold_block(
    heads: Sequence[HeadRefs],
    q_pos: jax.Array,
    spans: Sequence[BlockSpan],
    sequence_of_row: jax.Array | None,
    spec: RaggedSpec,
    masked: bool,
    page_size: int,
    *,
    exact: bool = False,
) -> None:
    """Folds one kv block of each sequence of an item into the running max, sum and
    accumulator of each of ``heads``, stage by stage across them (every head's scores, then
    every head's softmax, then every head's ``p @ v``): the heads' dependent chains, each a
    matmul, a cross-lane max, an ``exp`` and a matmul, overlap in one basic block and take
    the MXUs in turn. An item of several sequences (``spans``, the decode call's) multiplies
    all its rows by each sequence's block and keeps, row by row, its own sequence's
    (``sequence_of_row [rows, 1]``; None for one sequence): their chains are one chain.
    ``q_pos [rows, 1]``: each row's position; ``masked``: False for blocks every row sees
    whole (module doc; then the spans' ``lo`` and ``hi`` are not read); ``page_size``:
    positions per page of the block; ``exact``: the blocks were copied exactly, no stale
    rows to zero (a packed pool's, module doc)."""
    dtype = heads[0].q.dtype
    precision = lax.Precision.HIGHEST if dtype == _F32 else None
    block_kv = heads[0].views[0][0].shape[0]
    int8 = len(heads[0].views[0]) == 4

    def by_row(values: Sequence[jax.Array]) -> jax.Array:
        """Each row's value of its own sequence, of one value per sequence."""
        chosen = values[0]
        for e, value in enumerate(values[1:], start=1):
            chosen = jnp.where(sequence_of_row == e, value, chosen)
        return chosen

    if masked and not int8 and not exact:  # first: off the scores' dependent chains
        for head in heads:
            for views, span in zip(head.views, spans, strict=True):
                zero_stale_rows(views[-1], span.hi - span.first, page_size)  # V, or the words
    kv = [[keys_values(views, dtype) for views in head.views] for head in heads]
    scores = []  # [rows, block_kv] each
    for head, head_kv in zip(heads, kv, strict=True):
        per_sequence = []
        for views, (k, _) in zip(head.views, head_kv, strict=True):
            k = k[...].astype(dtype)
            dims = (((1,), (1,)), ((), ()))
            s = lax.dot_general(head.q[...], k, dims, preferred_element_type=_F32,
                                precision=precision)  # fmt: skip
            per_sequence.append(s * views[2][...].reshape(1, block_kv) if int8 else s)
        scores.append(by_row(per_sequence))
    scores = [apply_softcap(s * spec.sm_scale, spec.softcap) for s in scores]
    iota = lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
    if masked:  # each row's own sequence's span: scalars, or [rows, 1] (no select of masks)
        first, lo, hi = (by_row(values) for values in zip(*spans, strict=True))
        kv_pos = first + iota
        visible = (kv_pos >= lo) & (kv_pos <= hi)  # held by a copied page
        visible = visible & (kv_pos <= q_pos)
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
        probabilities.append((p, alpha))
    for (p, alpha), head, head_kv in zip(probabilities, heads, kv, strict=True):
        per_sequence = []
        for e, views in enumerate(head.views):
            p_e = p
            if int8:
                v_scales = views[3][...].reshape(1, block_kv)
                if masked:  # the scales outside the sequence's span: stale, maybe not finite
                    kv_pos = spans[e].first + iota
                    seen = (kv_pos >= spans[e].lo) & (kv_pos <= spans[e].hi)
                    v_scales = jnp.where(seen, v_scales, 0.0)
                p_e = p * v_scales
            per_sequence.append(lax.dot_general(
                p_e.astype(dtype), head_kv[e][1][...].astype(dtype), (((1,), (0,)), ((), ())),
                preferred_element_type=_F32, precision=precision,
            ))  # fmt: skip
        head.acc[...] = head.acc[...] * alpha[:, :1] + by_row(per_sequence)


def keys_values(views: Sequence[jax.Ref], dtype: jnp.dtype) -> tuple[jax.Ref | jax.Array, ...]:
    """One sequence's block's keys and values ``[block_kv, head_dim]``: its refs (read where
    they are used), or a packed block's words unpacked into ``dtype`` (`pf.unpack_kv`)."""
    if len(views) == 1:
        return unpack_kv(views[0][...], dtype)
    return views[0], views[1]


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
