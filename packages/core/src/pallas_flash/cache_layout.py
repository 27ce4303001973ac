"""The memory layout of a decode cache: row-major, the layout the kernels read.

XLA on TPU lays out an array whose last dimension is narrower than the 128 lanes (a cache
``[batch, kv_heads, max_len, head_dim]`` with ``head_dim`` 64) with its sequence axis minor,
so that the last dimension is not padded. A Mosaic kernel reads its operands row-major, so a
cache left in that default layout is re-laid out, a copy of the whole cache, before every
kernel call, and a jit that updates it cannot return it in place.

A cache made by `zeros_cache` is row-major, and a jit that returns an updated cache keeps it
so when its ``out_shardings`` give the cache `cache_format`: input and output then alias and
the update is in place. The price, for ``head_dim`` below 128, is lane padding: a cache with
``head_dim`` 64 takes twice its size in HBM. On CPU and GPU row-major is the default layout
and both functions change nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout


def cache_format(sharding: jax.sharding.Sharding, rank: int = 4) -> Format:
    """``sharding`` with the row-major layout of a rank-``rank`` array (the last axis minor),
    for a jit's ``in_shardings``/``out_shardings``."""
    return Format(Layout(major_to_minor=tuple(range(rank))), sharding)


def kept_format(cache: jax.Array | jax.ShapeDtypeStruct) -> Format | None:
    """The ``out_shardings`` entry of a jit that returns ``cache`` updated: its own placement,
    row-major (`cache_format`); None for a traced cache, whose placement is the enclosing
    jit's to decide."""
    if isinstance(cache, jax.core.Tracer):
        return None
    return cache_format(cache.sharding, cache.ndim)


def zeros_cache(
    shape: tuple[int, ...],
    dtype: jnp.dtype,
    sharding: jax.sharding.Sharding | None = None,
) -> jax.Array:
    """A zero cache (``[batch, kv_heads, max_len, head_dim]``, pages, or their scales),
    row-major.

    Args:
      sharding: its placement; default: the first device.
    """
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = cache_format(sharding, len(shape))
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=placed)()
