"""Float64 NumPy reference for scaled dot-product attention, its gradient and decode.

Every backend is compared against these functions, so they favour clarity over speed and
share no code with any backend. All arithmetic happens in float64 and all results are
float64 NumPy arrays, whatever the input dtype (bfloat16 and JAX arrays included).

Layouts: ``q`` is ``[batch, q_heads, q_len, head_dim]``; ``k`` and ``v`` are
``[batch, kv_heads, kv_len, head_dim]``; ``q_heads`` must be a multiple of ``kv_heads`` and
query head ``h`` reads kv head ``h // (q_heads // kv_heads)`` (grouped-query attention;
``kv_heads == 1`` is multi-query attention).

Visibility: query row ``i`` sits at key position ``p = i + q_offset``. Each option that is
given restricts which keys ``j`` the row sees, and all of them must agree:

- ``causal``: ``j <= p``;
- ``window=(left, right)``: ``p - left <= j <= p + right``;
- ``segment_ids=(q_ids [batch, q_len], kv_ids [batch, kv_len])``: equal ids;
- ``mask``: boolean, broadcastable to ``[batch, q_heads, q_len, kv_len]``, True = visible.

A query row that sees no key outputs zeros and passes back zero gradients.

Sinks (``sinks [q_heads]``): one more logit per query head in every row's softmax, with no
value: ``p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))``, so a row's weights sum to less
than 1 (and a row that sees no key still outputs zeros).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike


def _f64(x: ArrayLike) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _expand_kv(x: np.ndarray, q_heads: int) -> np.ndarray:
    """Repeat each kv head so that head ``h`` of the result is the one query head ``h`` uses."""
    kv_heads = x.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    return np.repeat(x, q_heads // kv_heads, axis=1)


def _sum_groups(x: np.ndarray, kv_heads: int) -> np.ndarray:
    """Inverse of ``_expand_kv`` for gradients: sum the query heads of each kv group."""
    batch, q_heads, length, dim = x.shape
    return x.reshape(batch, kv_heads, q_heads // kv_heads, length, dim).sum(axis=2)


def _visible(
    shape: tuple[int, int, int, int],
    *,
    causal: bool,
    q_offset: int,
    window: tuple[int, int] | None,
    segment_ids: tuple[ArrayLike, ArrayLike] | None,
    mask: ArrayLike | None,
) -> np.ndarray:
    """Boolean ``[batch, q_heads, q_len, kv_len]``: True where query row i sees key j."""
    _, _, q_len, kv_len = shape
    pos = np.arange(q_len)[:, None] + q_offset
    key = np.arange(kv_len)[None, :]
    visible = np.ones(shape, dtype=bool)
    if causal:
        visible &= key <= pos
    if window is not None:
        left, right = window
        visible &= (pos - left <= key) & (key <= pos + right)
    if segment_ids is not None:
        q_ids, kv_ids = (np.asarray(ids) for ids in segment_ids)
        visible &= q_ids[:, None, :, None] == kv_ids[:, None, None, :]
    if mask is not None:
        visible &= np.asarray(mask, dtype=bool)
    return visible


def _probabilities(
    q: ArrayLike,
    k: ArrayLike,
    *,
    sm_scale: float,
    causal: bool = False,
    q_offset: int = 0,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    segment_ids: tuple[ArrayLike, ArrayLike] | None = None,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over the visible keys (and the sinks), and the raw scores
    ``q @ k^T * sm_scale``.

    Both are ``[batch, q_heads, q_len, kv_len]`` float64; rows without a visible key are all
    zeros. The keyword arguments are those of `attention`.
    """
    q, k = _f64(q), _expand_kv(_f64(k), np.shape(q)[1])
    raw = q @ k.swapaxes(-1, -2) * sm_scale
    scores = raw if softcap is None else softcap * np.tanh(raw / softcap)
    if bias is not None:
        scores = scores + _f64(bias)
    visible = _visible(
        raw.shape,
        causal=causal,
        q_offset=q_offset,
        window=window,
        segment_ids=segment_ids,
        mask=mask,
    )
    scores = np.where(visible, scores, -np.inf)
    sink = np.full((*raw.shape[:-1], 1), -np.inf)  # [batch, q_heads, q_len, 1]: none
    if sinks is not None:
        sink = np.broadcast_to(_f64(sinks)[None, :, None, None], sink.shape)
    row_max = np.maximum(scores.max(axis=-1, keepdims=True), sink)
    shift = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.exp(scores - shift)
    total = weights.sum(axis=-1, keepdims=True) + np.exp(sink - shift)
    probs = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
    return probs, raw


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, **options: Any) -> np.ndarray:
    """Attention output ``[batch, q_heads, q_len, head_dim]`` (layouts in the module doc).

    ``scores = q @ k^T * sm_scale``, then ``softcap * tanh(scores / softcap)`` when
    ``softcap`` is given, then ``+ bias`` (broadcastable to
    ``[batch, q_heads, q_len, kv_len]``); softmax over the visible keys; ``@ v``.

    Keyword arguments (those of `_probabilities`): ``sm_scale`` (required), ``causal``,
    ``q_offset`` (key position of query row 0), ``window`` ``(left, right)``, ``softcap``,
    ``segment_ids`` ``(q_ids, kv_ids)``, ``bias``, ``mask`` (True = visible), ``sinks``
    ``[q_heads]`` (module doc).
    """
    probs, _ = _probabilities(q, k, **options)
    return probs @ _expand_kv(_f64(v), np.shape(q)[1])


def attention_vjp(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, d_out: ArrayLike, **options: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients ``(dq, dk, dv)`` of ``sum(attention(q, k, v, **options) * d_out)``.

    ``d_out`` has the layout of the output; ``dq`` that of ``q``; ``dk`` and ``dv`` that of
    ``k`` and ``v`` (summed over the query heads of each kv group). ``bias`` and ``mask``
    receive no gradient.
    """
    sm_scale, softcap = options["sm_scale"], options.get("softcap")
    q, d_out = _f64(q), _f64(d_out)
    q_heads, kv_heads = q.shape[1], np.shape(k)[1]
    k, v = _expand_kv(_f64(k), q_heads), _expand_kv(_f64(v), q_heads)
    probs, raw = _probabilities(q, k, **options)
    out = probs @ v

    dv = probs.swapaxes(-1, -2) @ d_out
    dp = d_out @ v.swapaxes(-1, -2)
    ds = probs * (dp - np.sum(d_out * out, axis=-1, keepdims=True))
    if softcap is not None:
        ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
    dq = ds @ k * sm_scale
    dk = ds.swapaxes(-1, -2) @ q * sm_scale
    return dq, _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)


def sinks_vjp(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, d_out: ArrayLike, **options: Any
) -> np.ndarray:
    """Gradient ``[q_heads]`` of ``sum(attention(q, k, v, **options) * d_out)`` with respect
    to ``options["sinks"]``: a sink's weight ``p = 1 - sum_j p_j`` in each row takes
    ``-p (d_out . out)``, summed over the batch and the rows."""
    probs, _ = _probabilities(q, k, **options)
    out = probs @ _expand_kv(_f64(v), np.shape(q)[1])
    sink_weight = 1.0 - probs.sum(axis=-1)  # [batch, q_heads, q_len]
    return -np.sum(sink_weight * np.sum(_f64(d_out) * out, axis=-1), axis=(0, 2))


def bias_vjp(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, d_out: ArrayLike, **options: Any
) -> np.ndarray:
    """Gradient of ``sum(attention(q, k, v, **options) * d_out)`` with respect to
    ``options["bias"]``, in the bias's shape: the gradient of the scores after the softcap,
    ``ds = p (dp - sum(d_out * out))`` (zero where a key is hidden), summed over the axes the
    bias broadcasts."""
    probs, _ = _probabilities(q, k, **options)
    v = _expand_kv(_f64(v), np.shape(q)[1])
    d_out = _f64(d_out)
    out = probs @ v
    ds = probs * (d_out @ v.swapaxes(-1, -2) - np.sum(d_out * out, axis=-1, keepdims=True))
    bias_shape = np.shape(options["bias"])
    ds = ds.sum(axis=tuple(range(ds.ndim - len(bias_shape))))
    broadcast = tuple(axis for axis, size in enumerate(bias_shape) if size == 1)
    return ds.sum(axis=broadcast, keepdims=True)


def decode(
    q: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    lengths: ArrayLike,
    *,
    sm_scale: float,
    softcap: float | None = None,
) -> np.ndarray:
    """Single-token attention over a ragged kv cache; returns ``[batch, q_heads, head_dim]``.

    ``q`` is ``[batch, q_heads, head_dim]``; ``k_cache`` and ``v_cache`` are
    ``[batch, kv_heads, max_len, head_dim]``; sequence ``b`` sees the cache positions below
    ``lengths[b]`` (ints in ``[0, max_len]``; 0 gives zeros).
    """
    q = _f64(q)
    lengths = np.asarray(lengths)
    max_len = np.shape(k_cache)[2]
    if np.any(lengths < 0) or np.any(lengths > max_len):
        raise ValueError(f"lengths must lie in [0, {max_len}], got {lengths}")
    mask = np.arange(max_len)[None, :] < lengths[:, None]
    out = attention(
        q[:, :, None, :],
        k_cache,
        v_cache,
        sm_scale=sm_scale,
        softcap=softcap,
        mask=mask[:, None, None, :],
    )
    return out[:, :, 0, :]


def ragged(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    query_starts: ArrayLike,
    kv_lengths: ArrayLike,
    **options: Any,
) -> np.ndarray:
    """Ragged attention of a flat batch of new tokens; returns ``[tokens, q_heads, head_dim]``.

    ``q`` is ``[tokens, q_heads, head_dim]``; ``k`` and ``v`` are each sequence's cache with its
    new tokens in it, ``[seqs, kv_heads, max_len, head_dim]``. Sequence ``s`` owns rows
    ``query_starts[s]`` to ``query_starts[s + 1] - 1``, its last ``n_s`` positions before
    ``kv_lengths[s]``, each seeing the positions up to its own; rows past
    ``query_starts[-1]`` are zeros. ``options``: ``sm_scale`` (required), ``softcap``,
    ``window=w`` (positions ``p - w`` to ``p``), ``sinks``.
    """
    q, starts, lengths = _f64(q), np.asarray(query_starts), np.asarray(kv_lengths)
    window = options.pop("window", None)
    out = np.zeros_like(q)
    for s, length in enumerate(lengths):
        first, end = starts[s], starts[s + 1]
        if first == end:
            continue
        rows = q[first:end].transpose(1, 0, 2)[None]  # [1, q_heads, n_s, head_dim]
        part = attention(
            rows, _f64(k)[s : s + 1, :, :length], _f64(v)[s : s + 1, :, :length], causal=True,
            q_offset=length - (end - first), window=None if window is None else (window, 0),
            **options,
        )  # fmt: skip
        out[first:end] = part[0].transpose(1, 0, 2)
    return out


def gather_pages(pages: ArrayLike, page_table: ArrayLike) -> np.ndarray:
    """A paged cache ``[num_pages, kv_heads, page_size, ...]`` read through ``page_table
    [batch, pages_per_sequence]`` as a contiguous ``[batch, kv_heads, pages_per_sequence *
    page_size, ...]`` (float64); every table entry must be a valid page."""
    pages = _f64(pages)
    gathered = pages[
        np.asarray(page_table)
    ]  # [batch, pages_per_sequence, kv_heads, page_size, ...]
    gathered = np.moveaxis(gathered, 2, 1)
    return gathered.reshape(*gathered.shape[:2], -1, *gathered.shape[4:])


def dequantize(values: ArrayLike, scales: ArrayLike) -> np.ndarray:
    """An int8 cache's values times their per-row scales, ``[..., head_dim]`` float64."""
    return _f64(values) * _f64(scales)[..., None]
