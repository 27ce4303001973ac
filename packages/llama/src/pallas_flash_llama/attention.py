"""The model's attention calls into Pallas-Flash: causal self-attention, cached decoding and
continuous batching's ragged step.

All take ``[batch, heads, seq, head_dim]`` (decode: one position; the ragged step: one row
of many sequences' new tokens) and pick the backend by name, or let the registry choose.
Under a mesh a Pallas kernel cannot be partitioned by XLA, so self-attention runs inside
``shard_map``: each device attends over its own batch rows (``data`` x ``fsdp``) and heads
(``tensor``); GQA keeps K/V unrepeated, each device holding the kv heads of its query heads.
Decoding writes the new token into a contiguous or paged, float or int8 cache (`kv_cache`)
and attends through ``pf.decode``; over a mesh, as the cache is split
(`kv_cache.CacheSplit`): a cache split over kv heads (a contiguous one: and batch) is written
and read inside ``shard_map``, each device on its own heads (and sequences), nothing
exchanged; a cache split along its sequence (a paged one: its pages) goes to ``pf.decode``
with the mesh, whose multi-device backends (``splitkv``) merge the devices' partials. The
ragged step writes its tokens into a paged cache and attends through
``pf.ragged_attention``; over a mesh, on a cache split over kv heads, inside ``shard_map``,
each device on its own heads.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, PartitionSpec

import pallas_flash as pf
from pallas_flash.cache_write import write_kv, write_rows
from pallas_flash_llama.kv_cache import CacheSplit, write_split
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
    cache: pf.DecodeCache,
    blocks: jax.Array,
    positions: jax.Array,
    lengths: jax.Array,
    *,
    backend: str | None,
    mesh: Mesh | None,
    split: CacheSplit = "heads",
) -> tuple[jax.Array, pf.DecodeCache]:
    """One decode step of one layer: the new token's K/V written into the cache in place
    (quantized when it is int8), then its query attends to each sequence's ``lengths[b]``
    positions.

    Args:
      q: ``[batch, q_heads, 1, head_dim]``.
      k, v: ``[batch, kv_heads, 1, head_dim]``.
      cache: the layer's cache (donated by the caller), contiguous or paged, float or int8;
        with ``mesh``, split over it as ``split`` says (`kv_cache.cache_sharding`).
      blocks: ``[batch]`` int32, where sequence ``b``'s token goes: its row of a contiguous
        cache, or its page of a paged one; a negative block: nowhere.
      positions: ``[batch]`` int32, the token's position in its block.
      lengths: ``[batch]`` int32 positions to attend to, the new token's included.

    Returns:
      The output ``[batch, q_heads, 1, head_dim]`` and the updated cache.
    """
    args = (q, k, v, cache, blocks, positions, lengths)
    if mesh is None or split == "sequence":
        return _write_and_decode(*args, backend=backend, mesh=mesh)

    def on_device(q, k, v, cache, blocks, positions, lengths):
        # a contiguous cache's blocks are the sequences: from the device's first one
        first = 0 if cache.paged else jax.lax.axis_index(BATCH_AXES) * q.shape[0]
        return _write_and_decode(q, k, v, cache, blocks - first, positions, lengths,
                                 backend=backend, mesh=None)  # fmt: skip

    heads = PartitionSpec(BATCH_AXES, "tensor", None, None)
    rows = PartitionSpec(BATCH_AXES)
    return jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(heads, heads, heads, _heads_layer(cache), rows, rows, rows),
        out_specs=(heads, _heads_layer(cache)),
        check_vma=False,
    )(*args)


def _heads_layer(cache: pf.DecodeCache) -> pf.DecodeCache:
    """The partition specs of a layer split over kv heads (`kv_cache.CacheSplit`): a
    contiguous one's batch over the batch axes too; a paged one's every page on every device
    (its heads only), its page table whole on each."""
    if not cache.paged:
        heads = PartitionSpec(BATCH_AXES, "tensor", None, None)
        scales = None if cache.k_scales is None else PartitionSpec(BATCH_AXES, "tensor", None)
        return pf.DecodeCache(heads, heads, None, scales, scales)
    pool = PartitionSpec(None, "tensor", None, None)
    scales = None if cache.k_scales is None else PartitionSpec(None, "tensor", None)
    return pf.DecodeCache(pool, None if cache.packed else pool, PartitionSpec(), scales, scales)


def _write_and_decode(q, k, v, cache, blocks, positions, lengths, *, backend, mesh):
    """`cached_attention` on one device, or with the cache's sequence axis (paged: its pages)
    split over ``mesh``."""
    axis = 0 if cache.paged else 2  # the axis the mesh splits: pages, or positions

    def write(array: jax.Array, rows: jax.Array) -> jax.Array:
        return write_rows(
            array, rows, blocks, positions, split=write_split(mesh), split_axis=axis,
            distinct_blocks=True,  # a sequence's row, or its own last page
        )  # fmt: skip

    cache = write_kv(cache, k[:, :, 0], v[:, :, 0], write)
    out = pf.decode(
        q[:, :, 0], cache.k, cache.v, lengths, page_table=cache.page_table,
        k_scales=cache.k_scales, v_scales=cache.v_scales, backend=backend, mesh=mesh,
    )  # fmt: skip
    return out[:, :, None], cache


def ragged_cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: pf.DecodeCache,
    query_starts: jax.Array,
    kv_lengths: jax.Array,
    *,
    backend: str | None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, pf.DecodeCache]:
    """One layer of a continuous-batching step: a flat batch of new tokens from many
    sequences, held as one row (``pf.ragged_attention``, which writes their K/V into the
    paged cache first).

    Args:
      q: ``[1, q_heads, tokens, head_dim]``.
      k, v: ``[1, kv_heads, tokens, head_dim]``.
      cache: the layer's paged cache (donated by the caller); with ``mesh``, its kv heads
        split over ``tensor`` (`kv_cache.pool_sharding`, ``"heads"``).
      query_starts: ``[seqs + 1]`` int32, sequence ``s``'s tokens from ``query_starts[s]``.
      kv_lengths: ``[seqs]`` int32 positions of each sequence once its tokens are cached.
      mesh: each device attends with its own heads (its batch axes of size 1).

    Returns:
      The output ``[1, q_heads, tokens, head_dim]`` and the updated cache.
    """

    def on_device(q, k, v, cache, query_starts, kv_lengths):
        flat = lambda x: x[0].swapaxes(0, 1)  # noqa: E731  [tokens, heads, head_dim]
        out, cache = pf.ragged_attention(
            flat(q), flat(k), flat(v), cache.k, cache.v, cache.page_table, query_starts,
            kv_lengths, k_scales=cache.k_scales, v_scales=cache.v_scales, backend=backend,
        )  # fmt: skip
        return out.swapaxes(0, 1)[None], cache

    args = (q, k, v, cache, query_starts, kv_lengths)
    if mesh is None:
        return on_device(*args)
    heads, whole = PartitionSpec(None, "tensor", None, None), PartitionSpec()
    return jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(heads, heads, heads, _heads_layer(cache), whole, whole),
        out_specs=(heads, _heads_layer(cache)),
        check_vma=False,
    )(*args)
