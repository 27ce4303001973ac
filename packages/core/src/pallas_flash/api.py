"""``pf.attention`` and ``pf.decode``: validate once, pick a backend, call it."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_flash import validation
from pallas_flash.capabilities import Capability, as_capabilities
from pallas_flash.context_layout import ContextExchange, ContextLayout
from pallas_flash.decode_cache import DecodeCache
from pallas_flash.decode_validation import check_decode
from pallas_flash.errors import UnsupportedFeatureError
from pallas_flash.registry import select_backend
from pallas_flash.specs import AttentionSpec, DecodeSpec, SegmentIds
from pallas_flash.validation import AttentionDims


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    segment_ids: SegmentIds | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    bias: jax.Array | None = None,
    mesh: jax.sharding.Mesh | None = None,
    context_layout: ContextLayout = "contiguous",
    context_exchange: ContextExchange = "ring",
    backend: str | None = None,
) -> jax.Array:
    """Scaled dot-product attention, ``softmax(q @ k^T * sm_scale) @ v``.

    Args:
      q: ``[batch, q_heads, q_len, head_dim]``.
      k: ``[batch, kv_heads, kv_len, head_dim]``, same floating dtype as q;
        ``q_heads % kv_heads == 0`` (GQA; ``kv_heads == 1`` is MQA).
      v: ``[batch, kv_heads, kv_len, v_head_dim]``, same dtype as q; ``v_head_dim`` may
        differ from ``head_dim`` (MLA) on backends that declare ``value_head_dim``.
      causal: query ``i`` sees key ``j`` iff ``j <= i + (kv_len - q_len)`` (queries aligned
        to the end of the keys).
      sm_scale: score scale; default ``1 / sqrt(head_dim)``.
      segment_ids: a query sees only keys with the same segment id.
      sliding_window: ``w`` or ``(left, right)``: the query at aligned position
        ``p = i + kv_len - q_len`` sees keys ``p - left <= j <= p + right``; with causal,
        ``right = 0``.
      softcap: if set, ``scores = softcap * tanh(scores / softcap)`` before masking.
      sinks: ``[q_heads]`` float: attention sinks, one learned logit per query head that
        joins every row's softmax denominator and has no value (``p_j = exp(s_j) /
        (exp(sinks[h]) + sum_k exp(s_k))``, in the scores' units, after ``sm_scale`` and
        ``softcap``); differentiable, its gradient accumulated in float32.
      bias: float, broadcastable to ``[batch, q_heads, q_len, kv_len]`` (lower ranks lead
        with size-1 axes, as in jax): added to the scores after ``sm_scale`` and ``softcap``
        (ALiBi, relative positions; ``-inf`` hides a key), on backends that declare ``bias``;
        differentiable.
      mesh: context parallelism, on backends that declare ``context_parallel``: the
        sequence (``q_len == kv_len``) is split over all the mesh's devices, in mesh order,
        and each device attends to every part of it in turn.
      context_layout: with ``mesh``, which tokens each device holds (`context_layout`):
        ``"contiguous"`` (device ``d`` the ``d``-th of equal chunks) or ``"zigzag"`` (chunks
        ``d`` and ``2 devices - 1 - d`` of twice as many, which balances causal work; the
        arrays' tokens must be in that order, segment ids too: `to_zigzag`, ``axis=1`` for
        ids).
      context_exchange: with ``mesh``, how the K/V chunks reach every device: ``"ring"``
        (passed one device on per step, the next step's chunks in flight while a step's
        kernels run; each device holds two steps' chunks) or ``"all_gather"`` (gathered at
        once and their gradients reduce-scattered home: fewer, larger collectives that
        `jax.lax` spreads over every link, holding the whole sequence's K/V and float32
        dK/dV per head group).
      backend: backend name; default: ``$PALLAS_FLASH_BACKEND``, else the best installed
        backend for the current platform.

    Returns:
      ``[batch, q_heads, q_len, v_head_dim]`` in the dtype of q. A query that sees no key gives
      zeros. Differentiable with respect to q, k, v (sinks, bias) where the backend declares
      ``grad``.

    Raises:
      InvalidInputError: a malformed argument (the message names it).
      UnsupportedFeatureError: the backend lacks a feature the call uses.
      BackendNotFoundError: the backend is not installed.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    dims = validation.check_qkv(q, k, v)
    causal = validation.check_causal(causal)
    spec = AttentionSpec(
        sm_scale=validation.check_sm_scale(sm_scale, dims.head_dim),
        causal=causal,
        q_offset=dims.kv_len - dims.q_len,
        window=validation.check_window(sliding_window, causal=causal),
        softcap=validation.check_softcap(softcap),
    )
    if segment_ids is not None:
        segment_ids = validation.check_segment_ids(segment_ids, dims)
    if sinks is not None:
        sinks = validation.check_sinks(sinks, dims)
    if bias is not None:
        bias = validation.check_bias(bias, dims)
    context = None
    if mesh is not None:
        validation.check_context_parallel(mesh, context_layout, context_exchange, dims)
        context = {"mesh": mesh, "context_layout": context_layout,
                   "context_exchange": context_exchange}  # fmt: skip
    return run_attention(
        q, k, v, spec, dims, backend=backend, segment_ids=segment_ids, bias=bias, sinks=sinks,
        context=context,
    )  # fmt: skip


def attention_features(
    spec: AttentionSpec,
    dims: AttentionDims,
    *,
    segment_ids: Any = None,
    bias: Any = None,
    mask: Any = None,
    sinks: Any = None,
    context: Any = None,
) -> frozenset[Capability]:
    """The capabilities one attention call needs (``grad`` is checked when differentiating)."""
    used = {
        Capability.ATTENTION: True,
        Capability.CAUSAL: spec.causal,
        Capability.GQA: dims.q_heads != dims.kv_heads,
        Capability.SEGMENT_IDS: segment_ids is not None,
        Capability.SLIDING_WINDOW: spec.window is not None,
        Capability.SOFTCAP: spec.softcap is not None,
        Capability.BIAS: bias is not None,
        Capability.MASK: mask is not None,
        Capability.SINKS: sinks is not None,
        Capability.VALUE_HEAD_DIM: dims.v_head_dim != dims.head_dim,
        Capability.CONTEXT_PARALLEL: context is not None,
    }
    return frozenset(feature for feature, needed in used.items() if needed)


def run_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    spec: AttentionSpec,
    dims: AttentionDims,
    *,
    backend: str | None,
    segment_ids: SegmentIds | None = None,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    sinks: jax.Array | None = None,
    context: dict[str, Any] | None = None,
) -> jax.Array:
    """Selects the backend for validated inputs (``[batch, heads, seq, head_dim]``) and calls
    it; ``context``: ``mesh`` and ``context_layout`` of a context-parallel call."""
    features = attention_features(
        spec, dims, segment_ids=segment_ids, bias=bias, mask=mask, sinks=sinks, context=context
    )
    impl = select_backend(backend, features)

    def call(q, k, v, segment_ids, bias, mask, sinks):
        # the newer features' arguments go only to the backends that declare them
        extra = {} if sinks is None else {"sinks": sinks}
        return impl.attention(
            q, k, v, spec, segment_ids=segment_ids, bias=bias, mask=mask, **extra,
            **(context or {}),
        )  # fmt: skip

    if Capability.GRAD not in as_capabilities(impl.capabilities):
        call = _gradient_raises(call, impl.name)
    return call(q, k, v, segment_ids, bias, mask, sinks)


def _gradient_raises(fn, backend_name: str):
    """Wraps ``fn`` so that differentiating it raises UnsupportedFeatureError."""

    @jax.custom_vjp
    def wrapped(*args):
        return fn(*args)

    def forward(*args):
        return fn(*args), None

    def backward(_, cotangent):
        raise UnsupportedFeatureError(
            f"backend {backend_name!r} does not support grad (differentiating attention); "
            "choose a backend that declares the 'grad' capability"
        )

    wrapped.defvjp(forward, backward)
    return wrapped


def decode(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array | None,
    lengths: jax.Array,
    *,
    page_table: jax.Array | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sm_scale: float | None = None,
    softcap: float | None = None,
    backend: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> jax.Array:
    """Attention of one new query token per sequence against a KV cache.

    The cache is contiguous, or paged when ``page_table`` is given, and holds q's dtype, or
    int8 with per-token scales (layouts: `pallas_flash.DecodeCache`).

    Args:
      q: ``[batch, q_heads, head_dim]``.
      k_cache: ``[batch, kv_heads, max_len, head_dim]``; paged: ``[num_pages, kv_heads,
        page_size, head_dim]``. q's dtype, or int8 with ``k_scales``; or, paged and packed,
        uint32 holding keys and values (`pallas_flash.pack_kv`, q 16-bit).
      v_cache: the shape and dtype of ``k_cache``; None for a packed cache.
      lengths: ``[batch]`` int32 in ``[0, max_len]`` (paged: ``max_len = pages_per_sequence
        * page_size``); sequence ``b`` attends to its positions ``< lengths[b]``. Concrete
        values outside the range raise; traced ones (under ``jit``) cannot be checked and
        count as the nearest end of it.
      page_table: ``[batch, pages_per_sequence]`` int32: position ``p`` of sequence ``b`` is
        row ``p % page_size`` of page ``page_table[b, p // page_size]``. Only the pages
        ``lengths`` use are read; concrete indices of those outside ``[0, num_pages)`` raise,
        traced ones are clipped into it.
      k_scales: for an int8 cache, float32 ``k_cache``'s shape without ``head_dim``: the
        cache's values are ``k_cache * k_scales[..., None]`` (`pallas_flash.quantize_int8`
        makes them).
      v_scales: the same for ``v_cache``.
      sm_scale: score scale; default ``1 / sqrt(head_dim)``.
      softcap: if set, ``scores = softcap * tanh(scores / softcap)``.
      backend: backend name (see `attention`).
      mesh: devices to split the cache over, for backends that declare ``multi_device``
        (a contiguous cache along its sequence axis, a paged pool along its pages: each
        device attends to the positions it holds); other backends ignore it.

    Returns:
      ``[batch, q_heads, head_dim]`` in the dtype of q; zeros where ``lengths[b] == 0``.
    """
    q, k_cache = jnp.asarray(q), jnp.asarray(k_cache)
    v_cache = None if v_cache is None else jnp.asarray(v_cache)
    lengths = jnp.asarray(lengths)
    optional = (page_table, k_scales, v_scales)
    cache = DecodeCache(
        k_cache, v_cache, *(None if x is None else jnp.asarray(x) for x in optional)
    )
    dims = check_decode(q, cache, lengths)
    spec = DecodeSpec(
        sm_scale=validation.check_sm_scale(sm_scale, dims.head_dim),
        softcap=validation.check_softcap(softcap),
    )
    if cache.paged:
        cache = cache._replace(page_table=cache.page_table.astype(jnp.int32))
    used = {
        Capability.DECODE: True,
        Capability.GQA: dims.q_heads != dims.kv_heads,
        Capability.SOFTCAP: spec.softcap is not None,
        Capability.PAGED_CACHE: cache.paged,
        Capability.INT8_CACHE: cache.quantized,
        Capability.PACKED_CACHE: cache.packed,
    }
    impl = select_backend(backend, frozenset(f for f, needed in used.items() if needed))
    return impl.decode(q, cache, lengths.astype(jnp.int32), spec, mesh=mesh)
