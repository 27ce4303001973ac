"""The interface every attention backend implements."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax

from pallas_flash.capabilities import Capability
from pallas_flash.decode_cache import DecodeCache
from pallas_flash.errors import UnsupportedFeatureError
from pallas_flash.ragged_write import write_new_tokens
from pallas_flash.specs import AttentionSpec, DecodeSpec, RaggedSpec, SegmentIds


class Backend:
    """Base class of an attention backend.

    A subclass sets the class attributes and implements `attention` and/or `decode`
    for the capabilities it declares. Core validates every call and checks its features
    against `capabilities` before calling the backend, so a backend sees only valid
    inputs and only features it declared.

    Attributes:
      name: the name users select the backend by (``backend="xla"``).
      capabilities: the `Capability` values (or their names) the backend implements.
      platforms: the ``jax.default_backend()`` platforms the backend is built for
        (``"cpu"``, ``"gpu"``, ``"tpu"``); automatic selection only considers these, while a
        backend selected by name may still run elsewhere (e.g. a Pallas kernel in interpret
        mode on CPU).
      priority: automatic selection prefers the highest priority among capable backends.
    """

    name: str = ""
    capabilities: Iterable[Capability | str] = frozenset()
    platforms: Iterable[str] = frozenset()
    priority: int = 0

    def attention(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        spec: AttentionSpec,
        *,
        segment_ids: SegmentIds | None = None,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        sinks: jax.Array | None = None,
        mesh: jax.sharding.Mesh | None = None,
        context_layout: str = "contiguous",
        context_exchange: str = "ring",
    ) -> jax.Array:
        """Attention output ``[batch, q_heads, q_len, v_head_dim]`` in the dtype of q.

        Args:
          q: ``[batch, q_heads, q_len, head_dim]``.
          k: ``[batch, kv_heads, kv_len, head_dim]``, same dtype as q.
          v: ``[batch, kv_heads, kv_len, v_head_dim]``, same dtype as q (``v_head_dim``
            other than ``head_dim`` only where the backend declares ``value_head_dim``).
          spec: the call's static settings.
          segment_ids: int32 ids ``q: [batch, q_len]``, ``kv: [batch, kv_len]``, or None.
          bias: additive, broadcastable to ``[batch, q_heads, q_len, kv_len]``, or None.
          mask: boolean (True = visible), broadcastable like ``bias``, or None.
          sinks: ``[q_heads]`` float, a logit per query head in every row's softmax
            denominator, differentiable (``sinks`` capability). Core passes it only to
            calls that use it, so a backend without the capability need not take it.
          mesh: context parallelism (``context_parallel``), passed likewise only to calls
            that use it: q, k and v (``q_len == kv_len``, divisible by the mesh's devices
            and chunks) are split along the sequence over all the mesh's devices.
          context_layout: with ``mesh``, which chunks each device holds (``contiguous`` or
            ``zigzag``: `pallas_flash.context_layout`).
          context_exchange: with ``mesh``, how K/V reach every device (``ring`` or
            ``all_gather``: `pallas_flash.context_layout`).
        """
        raise UnsupportedFeatureError(f"backend {self.name!r} does not implement attention")

    def decode(
        self,
        q: jax.Array,
        cache: DecodeCache,
        lengths: jax.Array,
        spec: DecodeSpec,
        *,
        mesh: jax.sharding.Mesh | None = None,
    ) -> jax.Array:
        """Decode output ``[batch, q_heads, head_dim]`` in the dtype of q.

        Args:
          q: ``[batch, q_heads, head_dim]``, one new token per sequence.
          cache: the validated cache: contiguous ``[batch, kv_heads, max_len, head_dim]`` or
            paged, float or int8 (`DecodeCache`); paged and int8 only when the backend
            declares ``paged_cache`` and ``int8_cache``.
          lengths: ``[batch]`` int32; sequence ``b`` sees its positions ``< lengths[b]``.
          spec: the call's static settings.
          mesh: devices to split the cache over; single-device backends ignore it.
        """
        raise UnsupportedFeatureError(f"backend {self.name!r} does not implement decode")

    def ragged_attention(
        self,
        q: jax.Array,
        cache: DecodeCache,
        query_starts: jax.Array,
        kv_lengths: jax.Array,
        spec: RaggedSpec,
        *,
        sinks: jax.Array | None = None,
    ) -> jax.Array:
        """Ragged attention output ``[tokens, q_heads, head_dim]`` in the dtype of q, zeros
        for padding rows (``pf.ragged_attention``; layout: `pallas_flash.ragged_batch`).

        Args:
          q: ``[tokens, q_heads, head_dim]``, the new tokens of every sequence, flat.
          cache: the paged cache with the new tokens' keys and values already written (core
            writes them), float or int8 (int8 only when the backend declares ``int8_cache``).
          query_starts: ``[seqs + 1]`` int32, each sequence's first row.
          kv_lengths: ``[seqs]`` int32, each sequence's positions, its new tokens included.
          spec: the call's static settings.
          sinks: ``[q_heads]``, passed only to calls that use it (``sinks`` capability).
        """
        raise UnsupportedFeatureError(f"backend {self.name!r} does not implement ragged attention")

    def ragged_attention_and_write(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        cache: DecodeCache,
        query_starts: jax.Array,
        kv_lengths: jax.Array,
        spec: RaggedSpec,
        *,
        sinks: jax.Array | None = None,
    ) -> tuple[jax.Array, DecodeCache]:
        """``pf.ragged_attention``: the output of `ragged_attention` and the cache with the new
        tokens' keys and values ``k``, ``v`` ``[tokens, kv_heads, head_dim]`` (q's dtype)
        written at their positions. By default core writes them into their pages
        (`pallas_flash.ragged_write`), then `ragged_attention` reads the written cache; a
        backend whose kernel writes them itself (reading each once, from the batch) overrides
        this, with the same result."""
        cache = write_new_tokens(cache, k, v, query_starts, kv_lengths)
        extra = {} if sinks is None else {"sinks": sinks}
        return self.ragged_attention(q, cache, query_starts, kv_lengths, spec, **extra), cache


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """What `pallas_flash.list_backends` reports about one installed backend.

    Attributes:
      name: the backend's name.
      capabilities: the features it implements.
      platforms: the platforms it is built for.
      priority: its rank in automatic selection.
      distribution: the installed distribution that provides it (None when registered
        directly with `pallas_flash.register_plugin`).
    """

    name: str
    capabilities: frozenset[Capability]
    platforms: frozenset[str]
    priority: int
    distribution: str | None
