"""Where a cache lives when no mesh is given: on one device, or split by its own sharding.

A cache is followed, never moved: a cache on one device (committed there or not) is decoded
on that device; a cache placed with a ``NamedSharding`` over several devices that partitions
only its split axis (`SEQUENCE_AXIS` of a contiguous ``[batch, kv_heads, max_len,
head_dim]`` cache, `PAGE_AXIS` of a paged ``[num_pages, kv_heads, page_size, head_dim]``
pool) is decoded over that sharding's mesh, each device on its own slice (its other mesh axes
hold copies, which repeat the work). Any other multi-device placement (batch or heads partitioned,
or a sharding without a mesh) would need the cache gathered or resharded first: rather than
copy a cache-sized array on every call, `follow` raises and names the argument.

Under ``jit`` a traced cache's sharding is not known when the kernel is traced, so a traced
cache counts as one device's: pass ``mesh=`` to split it.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_flash as pf

SEQUENCE_AXIS = 2
"""A contiguous cache's sequence (``max_len``) axis."""

PAGE_AXIS = 0
"""A paged cache's pages (``num_pages``) axis."""

Split = tuple[Mesh, tuple[str, ...]]
"""A mesh and the names of its axes that split the cache's split axis (none: every device
holds the whole cache)."""


def _axes(entry: str | tuple[str, ...] | None, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes of more than one device in one entry of a ``PartitionSpec``."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(name for name in names if mesh.shape[name] > 1)


def axis_split(x: jax.Array, axis: int = SEQUENCE_AXIS) -> Split | None:
    """How ``x`` (a cache, layouts in the module doc) is split along ``axis``: its mesh and the
    axes that split it, when ``x`` is a concrete array placed with a ``NamedSharding`` over
    several devices that partitions no other axis; None otherwise."""
    if isinstance(x, jax.core.Tracer):
        return None
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.size == 1:
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    if any(_axes(entry, sharding.mesh) for i, entry in enumerate(spec) if i != axis):
        return None
    return sharding.mesh, _axes(spec[axis], sharding.mesh)


def _on_one_device(x: jax.Array) -> bool:
    """Whether ``x`` is traced (placement unknown), a host value or on a single device."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return True
    return len(x.sharding.device_set) == 1


def follow(
    k_cache: jax.Array, v_cache: jax.Array | None, axis: int = SEQUENCE_AXIS
) -> Split | None:
    """The split that decoding with ``mesh=None`` follows: None for one device (see the module
    doc); ``axis``: the caches' split axis; ``v_cache`` None: a packed cache's one array.

    Raises:
      pf.InvalidInputError: a cache is on several devices in a way that cannot be followed,
        or the two caches are placed differently.
    """
    splits = []
    caches = [("k_cache", k_cache)] + ([] if v_cache is None else [("v_cache", v_cache)])
    for name, cache in caches:
        if _on_one_device(cache):
            splits.append(None)
            continue
        split = axis_split(cache, axis)
        if split is None:
            what = "sequence" if axis == SEQUENCE_AXIS else "pages"
            raise pf.InvalidInputError(
                f"{name}: expected a cache on one device, or a NamedSharding over several "
                f"devices that partitions only the {what} axis (axis {axis}), got "
                f"{cache.sharding}; reshard it, or pass mesh= to split the {what} axis"
            )
        splits.append(split)
    if splits[0] != splits[-1]:
        raise pf.InvalidInputError(
            f"v_cache: expected the placement of k_cache ({k_cache.sharding}), "
            f"got {v_cache.sharding}"
        )
    return splits[0]


def drop_last_axis(sharding: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    """The placement of an int8 cache's scales (its shape without ``head_dim``) for the values'
    ``sharding``: the same partition of the other axes."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
        return NamedSharding(sharding.mesh, PartitionSpec(*spec[:3]))
    return sharding
