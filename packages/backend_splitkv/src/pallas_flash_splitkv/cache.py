"""`KVCache`: a preallocated decode cache whose append writes in place.

A decode loop that rebuilds its cache with ``jnp.concatenate`` copies the whole cache every
token. `KVCache.append` instead writes each sequence's new K/V row at position
``lengths[b]`` with ``dynamic_update_slice`` inside a jit that donates the old cache, so XLA
updates the buffers in place. A cache whose sequence axis is split over a mesh
(`placement.sequence_split`) is appended to inside ``shard_map``: each device writes the row
only if the position falls in its slice, so an append moves no cache data between devices.
The buffers are row-major (`pf.zeros_cache`) and every append returns them so
(`pf.cache_format`): on TPU a ``head_dim`` under 128 would otherwise be laid out sequence-minor
and copied for the kernel on every call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format

import pallas_flash as pf
from pallas_flash.cache_write import write_token
from pallas_flash_splitkv import placement


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys, values and lengths of a batch of sequences being decoded.

    Attributes:
      k: ``[batch, kv_heads, max_len, head_dim]``.
      v: ``[batch, kv_heads, max_len, head_dim]``.
      lengths: ``[batch]`` int32; positions ``>= lengths[b]`` of sequence ``b`` are unused.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def empty(
        cls,
        batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.bfloat16,
        sharding: jax.sharding.Sharding | None = None,
    ) -> KVCache:
        """A zero cache of ``max_len`` positions per sequence, all lengths 0.

        Args:
          sharding: placement of k and v, e.g. ``NamedSharding(mesh, P(None, None, "kv"))``
            to split the sequence axis over a mesh as `decode` does.
        """
        shape = (batch, kv_heads, max_len, head_dim)
        k = pf.zeros_cache(shape, dtype, sharding)
        v = pf.zeros_cache(shape, dtype, sharding)
        return cls(k, v, jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def append(self, k_new: jax.Array, v_new: jax.Array) -> KVCache:
        """The cache with one more token per sequence, written in place.

        This cache's buffers are donated: do not use it afterwards, only the returned one.
        A cache whose sequence axis is split by a ``NamedSharding`` is written by each device
        in its own slice (no collective); under a trace its sharding is unknown and the write
        is left to XLA's partitioner, so call ``append`` outside ``jit``.

        Args:
          k_new: ``[batch, kv_heads, head_dim]``, the new token's keys.
          v_new: ``[batch, kv_heads, head_dim]``, its values.

        Raises:
          pf.InvalidInputError: ``k_new`` or ``v_new`` does not match the cache, or (when the
            lengths are on the host, not traced) a sequence is already full. Under a trace a
            full sequence is left unchanged: stop appending at ``max_len``.
        """
        expected = (self.k.shape[0], self.k.shape[1], self.k.shape[3])
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            if tuple(jnp.shape(x)) != expected:
                raise pf.InvalidInputError(
                    f"{name}: expected shape {expected} [batch, kv_heads, head_dim], "
                    f"got {tuple(jnp.shape(x))}"
                )
        if not isinstance(self.lengths, jax.core.Tracer):
            full = np.flatnonzero(np.asarray(self.lengths) >= self.max_len)
            if full.size:
                raise pf.InvalidInputError(
                    f"lengths: expected room for one more token, got full sequences "
                    f"{full.tolist()} (max_len={self.max_len})"
                )
        step = append_step(pf.kept_format(self.k), placement.sequence_split(self.k))
        return step(self, k_new, v_new)

    def decode(self, q: jax.Array, **kwargs: object) -> jax.Array:
        """``pf.decode(q, self.k, self.v, self.lengths, **kwargs)``."""
        return pf.decode(q, self.k, self.v, self.lengths, **kwargs)


@functools.cache
def append_step(
    kept: Format | None, split: placement.Split | None
) -> Callable[[KVCache, jax.Array, jax.Array], KVCache]:
    """`KVCache.append` without the checks, jitted with the cache donated and returned in
    ``kept`` (`pallas_flash.cache_layout.kept_format`), so that it is written in place."""
    return jax.jit(
        functools.partial(_append, split=split),
        donate_argnums=0,
        out_shardings=KVCache(kept, kept, None),
    )


def _append(
    cache: KVCache, k_new: jax.Array, v_new: jax.Array, split: placement.Split | None
) -> KVCache:
    """The cache with one more token per sequence; a full sequence is left unchanged.

    With a ``split`` (the cache's sequence axis split over a mesh) each device writes only the
    positions in its own slice, so no cache row crosses the interconnect
    (`pallas_flash.cache_write`).
    """
    room = cache.lengths < cache.max_len
    positions = jnp.where(room, cache.lengths, -1)  # a full sequence is written nowhere
    k = write_token(cache.k, k_new, positions, split=split)
    v = write_token(cache.v, v_new, positions, split=split)
    return KVCache(k, v, cache.lengths + room.astype(jnp.int32))
