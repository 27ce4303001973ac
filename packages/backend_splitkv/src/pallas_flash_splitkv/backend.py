"""The ``splitkv`` backend: Split-KV FlashDecoding for TPU v5e, on one chip or a mesh."""

from __future__ import annotations

import jax

import pallas_flash as pf
from pallas_flash_splitkv.blocks import DecodeBlocks
from pallas_flash_splitkv.decode import split_kv_decode
from pallas_flash_splitkv.ragged_attention import ragged_attention, ragged_attention_and_write
from pallas_flash_splitkv.ragged_blocks import RaggedBlocks


class SplitKvBackend(pf.Backend):
    """Decoding (one query token per sequence) with a Pallas Split-KV kernel, and ragged
    attention (decode tokens and prefill chunks of many sequences in one flat batch) against a
    paged cache with `ragged_kernel` (its calls: `pallas_flash_splitkv.ragged_attention`).

    With ``mesh=None`` the cache is decoded where it is: on its one device, or over the mesh
    of a ``NamedSharding`` that splits only its sequence axis (`placement.follow`); pass a
    mesh to split the sequence axis over its devices.

    Args:
      blocks: the decode kernel's tiling; default `DecodeBlocks()`.
      name: the name to select this instance by.
      ragged_blocks: the ragged kernel's tiling; default `RaggedBlocks()`.
    """

    name = "splitkv"
    capabilities = frozenset(
        {
            pf.Capability.DECODE,
            pf.Capability.RAGGED,
            pf.Capability.GQA,
            pf.Capability.SOFTCAP,
            pf.Capability.PAGED_CACHE,
            pf.Capability.INT8_CACHE,
            pf.Capability.PACKED_CACHE,
            pf.Capability.MULTI_DEVICE,
            pf.Capability.SLIDING_WINDOW,
            pf.Capability.SINKS,
        }
    )
    platforms = frozenset({"tpu"})
    priority = 100

    def __init__(
        self,
        blocks: DecodeBlocks | None = None,
        *,
        name: str = "splitkv",
        ragged_blocks: RaggedBlocks | None = None,
    ) -> None:
        self.blocks = DecodeBlocks() if blocks is None else blocks
        self.ragged_blocks = RaggedBlocks() if ragged_blocks is None else ragged_blocks
        self.name = name

    def __repr__(self) -> str:
        return (
            f"SplitKvBackend({self.blocks!r}, name={self.name!r}, "
            f"ragged_blocks={self.ragged_blocks!r})"
        )

    def decode(
        self,
        q: jax.Array,
        cache: pf.DecodeCache,
        lengths: jax.Array,
        spec: pf.DecodeSpec,
        *,
        mesh: jax.sharding.Mesh | None = None,
    ) -> jax.Array:
        return split_kv_decode(q, cache, lengths, spec=spec, blocks=self.blocks, mesh=mesh)

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
        return ragged_attention(
            q, cache, query_starts, kv_lengths, spec=spec, blocks=self.ragged_blocks, sinks=sinks
        )

    def ragged_attention_and_write(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        cache: pf.DecodeCache,
        query_starts: jax.Array,
        kv_lengths: jax.Array,
        spec: pf.RaggedSpec,
        *,
        sinks: jax.Array | None = None,
    ) -> tuple[jax.Array, pf.DecodeCache]:
        """A packed cache's new tokens written by the ragged kernel itself, each read once
        (`ragged_attention_and_write`); other caches written by core first."""
        if not cache.packed:
            return super().ragged_attention_and_write(
                q, k, v, cache, query_starts, kv_lengths, spec, sinks=sinks
            )
        return ragged_attention_and_write(q, k, v, cache, query_starts, kv_lengths, spec=spec,
                                          blocks=self.ragged_blocks, sinks=sinks)  # fmt: skip
