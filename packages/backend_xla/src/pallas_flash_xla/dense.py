"""Dense attention: the whole ``[batch, heads, q_len, kv_len]`` score matrix in HBM.

GQA is computed without repeating K/V: queries are viewed as
``[batch, kv_heads, group, q_len, head_dim]`` so each kv head serves its group by broadcasting.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import pallas_flash as pf
from pallas_flash.masking import apply_softcap, positional_mask
from pallas_flash.ragged_batch import token_places

_F32 = jnp.float32


def _and(a: jax.Array | None, b: jax.Array | None) -> jax.Array | None:
    if a is None:
        return b
    if b is None:
        return a
    return a & b


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """``[batch, heads, ...]`` to ``[batch, kv_heads, group, ...]``; a size-1 head axis stays 1."""
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


def _softmax_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    sm_scale: float,
    softcap: float | None,
    bias: jax.Array | None,
    visible: jax.Array | None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """``softmax(softcap(q k^T * sm_scale) + bias, masked) @ v`` in float32.

    Args:
      q: ``[batch, kv_heads, group, q_len, head_dim]``.
      k: ``[batch, kv_heads, kv_len, head_dim]``.
      v: ``[batch, kv_heads, kv_len, head_dim]``.
      sm_scale: score scale.
      softcap: soft-cap of the scores, or None.
      bias: added to the scores, broadcastable to ``[batch, kv_heads, group, q_len, kv_len]``,
        or None.
      visible: boolean, True where a key is visible, broadcastable like bias, or None.
      sinks: ``[kv_heads, group]``: a logit per query head in each row's denominator, or
        None.

    Returns:
      ``[batch, kv_heads, group, q_len, head_dim]`` in the dtype of q; rows that see no key
      are zero.
    """
    scores = jnp.einsum(
        "bkgtd,bksd->bkgts", q, k, preferred_element_type=_F32, precision=lax.Precision.HIGHEST
    )
    scores = apply_softcap(scores * sm_scale, softcap)
    if bias is not None:
        scores = scores + bias.astype(_F32)
    if visible is not None:
        scores = jnp.where(visible, scores, -jnp.inf)
    # Softmax is shift-invariant, so the row max only guards exp() and carries no gradient.
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(_F32)[None, :, :, None, None]  # [1, kv_heads, group, 1, 1]
        row_max = jnp.maximum(row_max, sink)
    row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    probs = jnp.exp(scores - row_max)
    row_sum = jnp.sum(probs, axis=-1, keepdims=True)
    if sinks is not None:
        row_sum = row_sum + jnp.exp(sink - row_max)
    probs = probs / jnp.where(row_sum == 0.0, 1.0, row_sum)
    out = jnp.einsum(
        "bkgts,bksd->bkgtd",
        probs.astype(v.dtype),
        v,
        preferred_element_type=_F32,
        precision=lax.Precision.HIGHEST,
    )
    return out.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("spec",))
def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    spec: pf.AttentionSpec,
    segment_ids: pf.SegmentIds | None,
    bias: jax.Array | None,
    mask: jax.Array | None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Dense attention; arguments as ``pf.Backend.attention``.

    Returns ``[batch, q_heads, q_len, v_head_dim]`` in the dtype of q.
    """
    batch, q_heads, q_len, _ = q.shape
    kv_heads, kv_len, v_head_dim = k.shape[1], k.shape[2], v.shape[3]
    visible = positional_mask(
        jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :], spec
    )  # [q_len, kv_len]
    if segment_ids is not None:
        same = segment_ids.q[:, :, None] == segment_ids.kv[:, None, :]  # [batch, q_len, kv_len]
        visible = _and(visible, same[:, None, None])
    if mask is not None:
        visible = _and(visible, _grouped(mask, kv_heads))
    out = _softmax_attention(
        _grouped(q, kv_heads),
        k,
        v,
        sm_scale=spec.sm_scale,
        softcap=spec.softcap,
        bias=None if bias is None else _grouped(bias, kv_heads),
        visible=visible,
        sinks=None if sinks is None else sinks.reshape(kv_heads, q_heads // kv_heads),
    )
    return out.reshape(batch, q_heads, q_len, v_head_dim)


def contiguous(cache: pf.DecodeCache, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """K and V ``[batch, kv_heads, max_len, head_dim]`` in ``dtype``: a paged cache's pages
    gathered in sequence order (indices clipped into the cache), a packed one unpacked (after
    the gather), an int8 one dequantized."""
    k, v, k_scales, v_scales = cache.k, cache.v, cache.k_scales, cache.v_scales
    if cache.paged:
        pages = jnp.clip(cache.page_table, 0, k.shape[0] - 1)

        def gather(x: jax.Array) -> jax.Array:  # [pages, heads, page_size, ...] to contiguous
            x = jnp.moveaxis(x[pages], 2, 1)  # [batch, heads, pages_per_sequence, page_size, ...]
            return x.reshape(*x.shape[:2], -1, *x.shape[4:])

        k, v = gather(k), None if cache.packed else gather(v)
        if cache.quantized:
            k_scales, v_scales = gather(k_scales), gather(v_scales)
    if cache.packed:
        return pf.unpack_kv(k, dtype)
    if cache.quantized:
        return pf.dequantize_int8(k, k_scales, dtype), pf.dequantize_int8(v, v_scales, dtype)
    return k, v


@functools.partial(jax.jit, static_argnames=("spec",))
def decode(
    q: jax.Array, cache: pf.DecodeCache, lengths: jax.Array, spec: pf.DecodeSpec
) -> jax.Array:
    """Dense decode; arguments as ``pf.Backend.decode``, output ``[batch, q_heads, head_dim]``.
    An int8 cache is dequantized to float32 and attended to in float32."""
    batch, q_heads, head_dim = q.shape
    k_cache, v_cache = contiguous(cache, _F32 if cache.quantized else q.dtype)
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    lengths = jnp.clip(lengths, 0, max_len)
    visible = jnp.arange(max_len)[None, :] < lengths[:, None]  # [batch, max_len]
    # Slots past a sequence's length may hold stale values, even NaN: a zero probability
    # times NaN is NaN, so they are zeroed, not just given zero weight.
    v_cache = jnp.where(visible[:, None, :, None], v_cache, 0)
    out = _softmax_attention(
        q.astype(k_cache.dtype).reshape(batch, kv_heads, q_heads // kv_heads, 1, head_dim),
        k_cache,
        v_cache,
        sm_scale=spec.sm_scale,
        softcap=spec.softcap,
        bias=None,
        visible=visible[:, None, None, None, :],
    )
    return out.reshape(batch, q_heads, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("spec",))
def ragged(
    q: jax.Array,
    cache: pf.DecodeCache,
    query_starts: jax.Array,
    kv_lengths: jax.Array,
    spec: pf.RaggedSpec,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Dense ragged attention; arguments as ``pf.Backend.ragged_attention``, output ``[tokens,
    q_heads, head_dim]``: each token attends to its own sequence's cache, gathered whole
    (``[tokens, kv_heads, max_len, head_dim]``). An int8 cache is attended to in float32."""
    tokens, q_heads, head_dim = q.shape
    k_cache, v_cache = contiguous(cache, _F32 if cache.quantized else q.dtype)
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    places = token_places(query_starts, kv_lengths, tokens)
    keys = jnp.arange(max_len)[None, :]
    visible = places.valid[:, None] & (keys <= places.position[:, None])  # [tokens, max_len]
    if spec.window is not None:
        visible &= keys >= places.position[:, None] - spec.window
    # as in decode: positions no token sees may hold stale values, even NaN
    v_tokens = jnp.where(visible[:, None, :, None], v_cache[places.sequence], 0)
    out = _softmax_attention(
        q.astype(k_cache.dtype).reshape(tokens, kv_heads, q_heads // kv_heads, 1, head_dim),
        k_cache[places.sequence],
        v_tokens,
        sm_scale=spec.sm_scale,
        softcap=spec.softcap,
        bias=None,
        visible=visible[:, None, None, None, :],
        sinks=None if sinks is None else sinks.reshape(kv_heads, q_heads // kv_heads),
    )
    return out.reshape(tokens, q_heads, head_dim).astype(q.dtype)
