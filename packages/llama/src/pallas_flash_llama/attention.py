"""The model's attention calls into Pallas-Flash: causal self-attention and cached decoding.

Both take ``[batch, heads, seq, head_dim]`` (decode: one position) and pick the backend by
name, or let the registry choose. Under a mesh a Pallas kernel cannot be partitioned by XLA,
so self-attention runs inside ``shard_map``: each device attends over its own batch rows
(``data`` x ``fsdp``) and heads (``tensor``); GQA keeps K/V unrepeated, each device holding
the kv heads of its query heads. Decoding hands the mesh to ``pf.decode``, whose
multi-device backends (``splitkv``) split the cache's sequence axis over all of it.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, PartitionSpec

import pallas_flash as pf
from pallas_flash_llama.sharding import BATCH_AXES


def self_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    *,
    backend: str | None,
    mesh: Mesh | None,
) -> jax.Array:
    """Causal attention of packed sequences: ``[batch, q_heads, seq, head_dim]``.

    Args:
      q: ``[batch, q_heads, seq, head_dim]``.
      k, v: ``[batch, kv_heads, seq, head_dim]``.
      segment_ids: ``[batch, seq]`` int32 document of each token (a token sees only earlier
        tokens of its own document), or None for one document per row.
    """

    def attend(q, k, v, *segments):
        ids = pf.SegmentIds(segments[0], segments[0]) if segments else None
        return pf.attention(q, k, v, causal=True, segment_ids=ids, backend=backend)

    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
    if mesh is None:
        return attend(*args)
    heads = PartitionSpec(BATCH_AXES, "tensor", None, None)
    specs = (heads,) * 3 + (PartitionSpec(BATCH_AXES, None),) * (len(args) - 3)
    return jax.shard_map(attend, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)(*args)


def cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    *,
    backend: str | None,
    mesh: Mesh | None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One decode step of one layer: the new token's K/V written into the cache in place,
    then its query attends to positions ``<= positions[b]``.

    Args:
      q: ``[batch, q_heads, 1, head_dim]``.
      k, v: ``[batch, kv_heads, 1, head_dim]``.
      k_cache, v_cache: ``[batch, kv_heads, max_len, head_dim]`` (donated by the caller),
        sequence axis split over all of ``mesh`` when one is given.
      positions: ``[batch]`` int32 position of the new token.

    Returns:
      The output ``[batch, q_heads, 1, head_dim]`` and the updated caches.
    """
    split = None if mesh is None else (mesh, tuple(mesh.axis_names))
    k_cache = pf.write_token(k_cache, k[:, :, 0], positions, split=split)
    v_cache = pf.write_token(v_cache, v[:, :, 0], positions, split=split)
    out = pf.decode(q[:, :, 0], k_cache, v_cache, positions + 1, backend=backend, mesh=mesh)
    return out[:, :, None], (k_cache, v_cache)
