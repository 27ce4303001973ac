"""The ``xla`` backend: dense attention compiled by XLA, every feature, every platform."""

from __future__ import annotations

import jax

import pallas_flash as pf
from pallas_flash_xla import dense


class XlaBackend(pf.Backend):
    """Plain ``jax.numpy`` attention: the baseline the kernels are measured against."""

    name = "xla"
    capabilities = frozenset(pf.Capability) - {
        pf.Capability.MULTI_DEVICE,
        pf.Capability.CONTEXT_PARALLEL,
    }
    platforms = frozenset({"cpu", "gpu", "tpu"})
    priority = 0

    def attention(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        spec: pf.AttentionSpec,
        *,
        segment_ids: pf.SegmentIds | None = None,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        sinks: jax.Array | None = None,
    ) -> jax.Array:
        return dense.attention(q, k, v, spec, segment_ids, bias, mask, sinks)

    def decode(
        self,
        q: jax.Array,
        cache: pf.DecodeCache,
        lengths: jax.Array,
        spec: pf.DecodeSpec,
        *,
        mesh: jax.sharding.Mesh | None = None,
    ) -> jax.Array:
        return dense.decode(q, cache, lengths, spec)

    def ragged_attention(
        self,
        q: jax.Array,
        cache: pf.DecodeCache,
        query_starts: jax.Array,
        kv_lengths: jax.Array,
        spec: pf.RaggedSpec,
        *,
        sinks: jax.Array | None = None,
    ) -> jax.Array:
        return dense.ragged(q, cache, query_starts, kv_lengths, spec, sinks)
