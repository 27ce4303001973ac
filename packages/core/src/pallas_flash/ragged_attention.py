"""``pf.ragged_attention``: one call over the new tokens of many sequences, decoding and
prefilling at once, against their paged cache (the serving engine's attention).

Core validates the call and hands the backend the new keys and values with the cache
(`pallas_flash.Backend.ragged_attention_and_write`): by default core writes them into their
pages (`pallas_flash.ragged_write`, quantized for an int8 cache, packed for a packed one) and
the backend's kernel reads the written cache; a backend whose kernel writes them itself reads
each new token once. Either way the write happens once, in place when the caller donates the
cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash import validation
from pallas_flash.capabilities import Capability
from pallas_flash.decode_cache import DecodeCache
from pallas_flash.ragged_validation import check_ragged
from pallas_flash.registry import select_backend
from pallas_flash.specs import RaggedSpec


def ragged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array | None,
    page_table: jax.Array,
    query_starts: jax.Array,
    kv_lengths: jax.Array,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sm_scale: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
    backend: str | None = None,
) -> tuple[jax.Array, DecodeCache]:
    """Causal attention of a flat batch of new tokens from many sequences against their paged
    cache, their own keys and values written into it first.

    Sequence ``s`` owns rows ``query_starts[s]`` to ``query_starts[s + 1] - 1`` of ``q``,
    ``k`` and ``v`` (one token while decoding, a chunk while prefilling, none for an empty
    slot), at its positions ``kv_lengths[s] - n_s`` to ``kv_lengths[s] - 1``; each token sees
    the sequence's positions up to its own (`pallas_flash.ragged_batch`). Rows from
    ``query_starts[-1]`` on are padding: written nowhere, their output zeros.

    Args:
      q: ``[tokens, q_heads, head_dim]``.
      k: ``[tokens, kv_heads, head_dim]``, q's dtype: the new tokens' keys (RoPE applied).
      v: the new tokens' values, shaped as ``k``.
      k_cache: ``[num_pages, kv_heads, page_size, head_dim]``, q's dtype, or int8 with
        ``k_scales``, or uint32 holding keys and values packed (`pallas_flash.pack_kv`, q
        16-bit: each new token written alone; `pallas_flash.DecodeCache`); donate it for the
        write to be in place.
      v_cache: the shape and dtype of ``k_cache``; None for a packed cache.
      page_table: ``[seqs, pages_per_sequence]`` int32: position ``p`` of sequence ``s`` is
        row ``p % page_size`` of page ``page_table[s, p // page_size]``.
      query_starts: ``[seqs + 1]`` int32, non-decreasing from 0, at most ``tokens``.
      kv_lengths: ``[seqs]`` int32 positions of each sequence once its new tokens are cached,
        at least its new tokens and at most ``pages_per_sequence * page_size``.
      k_scales: float32 ``[num_pages, kv_heads, page_size]`` for an int8 cache.
      v_scales: the same for ``v_cache``.
      sm_scale: score scale; default ``1 / sqrt(head_dim)``.
      softcap: if set, ``scores = softcap * tanh(scores / softcap)``.
      sliding_window: ``w``: a token at position ``p`` sees positions ``p - w`` to ``p``.
      sinks: ``[q_heads]`` float: a logit per query head in every row's softmax denominator.
      backend: backend name (see `pallas_flash.attention`).

    Concrete values out of range raise; traced ones cannot be checked: backends clip page
    indices into the cache, and a token whose page is out of range is written nowhere.

    Returns:
      The output ``[tokens, q_heads, head_dim]`` in q's dtype, and the cache with the new
      keys and values written (``page_table`` unchanged).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    optional = (k_scales, v_scales)
    v_cache = None if v_cache is None else jnp.asarray(v_cache)
    cache = DecodeCache(jnp.asarray(k_cache), v_cache, jnp.asarray(page_table),
                        *(None if x is None else jnp.asarray(x) for x in optional))  # fmt: skip
    query_starts, kv_lengths = jnp.asarray(query_starts), jnp.asarray(kv_lengths)
    dims = check_ragged(q, k, v, cache, query_starts, kv_lengths)
    spec = RaggedSpec(
        sm_scale=validation.check_sm_scale(sm_scale, dims.head_dim),
        softcap=validation.check_softcap(softcap),
        window=None if sliding_window is None else validation.check_window(
            sliding_window, causal=True)[0],
    )  # fmt: skip
    if sinks is not None:
        sinks = validation.check_sinks(sinks, dims)
    used = {
        Capability.RAGGED: True,
        Capability.GQA: dims.q_heads != dims.kv_heads,
        Capability.SOFTCAP: spec.softcap is not None,
        Capability.SLIDING_WINDOW: spec.window is not None,
        Capability.SINKS: sinks is not None,
        Capability.INT8_CACHE: cache.quantized,
        Capability.PACKED_CACHE: cache.packed,
    }
    impl = select_backend(backend, frozenset(f for f, needed in used.items() if needed))
    cache = cache._replace(page_table=cache.page_table.astype(jnp.int32))
    query_starts, kv_lengths = query_starts.astype(jnp.int32), kv_lengths.astype(jnp.int32)
    extra = {} if sinks is None else {"sinks": sinks}
    return impl.ragged_attention_and_write(q, k, v, cache, query_starts, kv_lengths, spec, **extra)
