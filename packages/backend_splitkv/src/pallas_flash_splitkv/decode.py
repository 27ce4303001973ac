"""Split-KV decoding on one device or with the cache's sequence axis split over a mesh.

Layouts: q ``[batch, q_heads, head_dim]``; the cache a `pf.DecodeCache` (contiguous or paged,
float or int8; a paged one on one device); ``lengths [batch]`` int32; the output ``[batch,
q_heads, head_dim]`` in q's dtype.

On one device the kernel's splits are merged by their log-sum-exps (`merge.merge`). Over a
mesh, ``shard_map`` gives each device a contiguous ``max_len / devices`` slice of every
sequence's cache and the query (replicated); each device runs the kernel on its slice with its
part of ``lengths`` (``clip(lengths - first position, 0, slice)``: a device past a sequence's
end sees no position of it and contributes weight 0), and the devices' partial outputs are
merged with one ``pmax`` and one ``psum`` of ``[batch, q_heads, head_dim]``-sized values
(`merge.merge_across`): the cache never crosses the interconnect. Without a mesh the cache
stays where it is (`placement.follow`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

import pallas_flash as pf
from pallas_flash.specs import DecodeSpec
from pallas_flash_splitkv import placement
from pallas_flash_splitkv.blocks import DecodeBlocks
from pallas_flash_splitkv.kernel import split_partials
from pallas_flash_splitkv.merge import merge, merge_across


def _local(
    q: jax.Array,
    cache: pf.DecodeCache,
    lengths: jax.Array,
    spec: DecodeSpec,
    blocks: DecodeBlocks,
    devices: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Output ``[batch, q_heads, head_dim]`` float32 and log-sum-exp ``[batch, q_heads]`` of
    one device's cache; ``devices``: how many devices run this at once."""
    batch, q_heads, head_dim = q.shape
    kv_heads = cache.k.shape[1]
    grouped = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    out, lse = split_partials(
        grouped,
        cache.k,
        cache.v,
        lengths,
        cache.page_table,
        cache.k_scales,
        cache.v_scales,
        spec=spec,
        blocks=blocks,
        devices=devices,
    )
    out, lse = merge(out, lse, axis=1)
    return out.reshape(batch, q_heads, head_dim), lse.reshape(batch, q_heads)


def split_kv_decode(
    q: jax.Array,
    cache: pf.DecodeCache,
    lengths: jax.Array,
    *,
    spec: DecodeSpec,
    blocks: DecodeBlocks,
    mesh: Mesh | None,
) -> jax.Array:
    """Decode output of validated inputs (layouts in the module doc).

    Args:
      q, cache, lengths, spec: as ``pf.Backend.decode``.
      blocks: the kernel's tiling of each device's slice.
      mesh: the devices to split the sequence axis over, all its axes flattened; one device:
        no split. None: follow the cache's placement (`placement.follow`): the device it is
        on, or the mesh of a ``NamedSharding`` that splits only its sequence axis (a traced
        cache: one device).

    Raises:
      pf.InvalidInputError: the mesh's devices do not divide ``max_len``; with ``mesh=None``,
        a cache on several devices that is not split only along its sequence axis.
      pf.UnsupportedFeatureError: a paged cache over several devices.
    """
    if mesh is None:
        split = placement.follow(cache.k, cache.v)
    else:
        split = None if mesh.size == 1 else (mesh, tuple(mesh.axis_names))
    if split is None:
        out, _ = _local(q, cache, lengths, spec, blocks)
        return out.astype(q.dtype)
    if cache.paged:
        raise pf.UnsupportedFeatureError(
            "splitkv decodes a paged cache on one device; pass mesh=None (or a one-device "
            "mesh), or split a contiguous cache's sequence axis over the mesh"
        )
    mesh, axes = split
    parts = math.prod(mesh.shape[name] for name in axes)
    if cache.max_len % parts:
        raise pf.InvalidInputError(
            f"k_cache: expected max_len divisible by the mesh's {parts} devices, "
            f"got max_len={cache.max_len}"
        )
    return _sharded(q, cache, lengths, spec=spec, blocks=blocks, mesh=mesh, axes=axes)


@functools.partial(jax.jit, static_argnames=("spec", "blocks", "mesh", "axes"))
def _sharded(
    q: jax.Array,
    cache: pf.DecodeCache,
    lengths: jax.Array,
    *,
    spec: DecodeSpec,
    blocks: DecodeBlocks,
    mesh: Mesh,
    axes: tuple[str, ...],
) -> jax.Array:
    """`split_kv_decode` over a mesh whose ``axes`` split the sequence (its other axes hold
    copies; no axes: every device decodes the whole cache), as one SPMD program (jitted: every
    device runs its kernel at once, which the TPU interpreter's simulated devices also need)."""
    part = cache.max_len // math.prod(mesh.shape[name] for name in axes)

    def on_device(q, cache, lengths):
        first = jax.lax.axis_index(axes) * part if axes else 0
        mine = jnp.clip(lengths - first, 0, part)
        out, lse = _local(q, cache, mine, spec, blocks, mesh.size)
        if axes:
            out, _ = merge_across(out, lse, axes)
        return out.astype(q.dtype)

    values = PartitionSpec(None, None, axes or None, None)
    scales = PartitionSpec(None, None, axes or None) if cache.quantized else None
    cache_specs = pf.DecodeCache(values, values, None, scales, scales)
    return jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(PartitionSpec(), cache_specs, PartitionSpec()),
        out_specs=PartitionSpec(),
        check_vma=False,
    )(q, cache, lengths)
