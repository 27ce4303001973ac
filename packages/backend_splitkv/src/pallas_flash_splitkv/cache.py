"""`KVCache`: a preallocated decode cache whose append writes in place.

A decode loop that rebuilds its cache with ``jnp.concatenate`` copies the whole cache every
token. `KVCache.append` instead writes each sequence's new K/V row at position
``lengths[b]`` with ``dynamic_update_slice`` inside a jit that donates the old cache, so XLA
updates the buffers in place. A cache whose sequence axis is split over a mesh
(`placement.axis_split`) is appended to inside ``shard_map``: each device writes the row
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
from pallas_flash.cache_write import write_kv, write_token
from pallas_flash_splitkv import placement


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys, values and lengths of a batch of sequences being decoded.

    Attributes:
      k: ``[batch, kv_heads, max_len, head_dim]``, q's dtype or int8.
      v: ``[batch, kv_heads, max_len, head_dim]``.
      lengths: ``[batch]`` int32; positions ``>= lengths[b]`` of sequence ``b`` are unused.
      k_scales, v_scales: ``[batch, kv_heads, max_len]`` float32 for an int8 cache (each
        appended row quantized by `pf.quantize_int8`), else None.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None

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
          dtype: q's dtype, or ``jnp.int8`` (then with scales, placed like k and v).
          sharding: placement of k and v, e.g. ``NamedSharding(mesh, P(None, None, "kv"))``
            to split the sequence axis over a mesh as `decode` does.
        """
        shape = (batch, kv_heads, max_len, head_dim)
        k = pf.zeros_cache(shape, dtype, sharding)
        v = pf.zeros_cache(shape, dtype, sharding)
        lengths = jnp.zeros((batch,), jnp.int32)
        if jnp.dtype(dtype) != jnp.int8:
            return cls(k, v, lengths)
        scales = placement.drop_last_axis(sharding)
        return cls(
            k, v, lengths,
            pf.zeros_cache(shape[:3], jnp.float32, scales),
            pf.zeros_cache(shape[:3], jnp.float32, scales),
        )  # fmt: skip

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
        check_token_shapes(k_new, v_new, (self.k.shape[0], self.k.shape[1], self.k.shape[3]))
        if not isinstance(self.lengths, jax.core.Tracer):
            check_room(np.asarray(self.lengths), self.max_len)
        scales = None if self.k_scales is None else pf.kept_format(self.k_scales)
        step = append_step(pf.kept_format(self.k), scales, placement.axis_split(self.k))
        return step(self, k_new, v_new)

    def decode(self, q: jax.Array, **kwargs: object) -> jax.Array:
        """``pf.decode`` of ``q [batch, q_heads, head_dim]`` against this cache."""
        return pf.decode(
            q, self.k, self.v, self.lengths, k_scales=self.k_scales, v_scales=self.v_scales,
            **kwargs,
        )  # fmt: skip


def check_token_shapes(k_new: jax.Array, v_new: jax.Array, expected: tuple[int, ...]) -> None:
    """Checks that an appended token's keys and values are ``expected``, ``[batch, kv_heads,
    head_dim]``.

    Raises:
      pf.InvalidInputError: naming the mismatched argument.
    """
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if tuple(jnp.shape(x)) != expected:
            raise pf.InvalidInputError(
                f"{name}: expected shape {expected} [batch, kv_heads, head_dim], "
                f"got {tuple(jnp.shape(x))}"
            )


def check_room(lengths: np.ndarray, max_len: int, active: np.ndarray | None = None) -> None:
    """Checks that every (``active``) sequence of concrete ``lengths`` has room for a token.

    Raises:
      pf.InvalidInputError: listing the full sequences.
    """
    full = lengths >= max_len if active is None else active & (lengths >= max_len)
    if full.any():
        raise pf.InvalidInputError(
            f"lengths: expected room for one more token, got full sequences "
            f"{np.flatnonzero(full).tolist()} (max_len={max_len})"
        )


@functools.cache
def append_step(
    kept: Format | None, kept_scales: Format | None, split: placement.Split | None
) -> Callable[[KVCache, jax.Array, jax.Array], KVCache]:
    """`KVCache.append` without the checks, jitted with the cache (and its scales) donated
    and returned in ``kept`` and ``kept_scales`` (`pallas_flash.cache_layout.kept_format`), so
    that it is written in place."""
    return jax.jit(
        functools.partial(_append, split=split),
        donate_argnums=0,
        out_shardings=KVCache(kept, kept, None, kept_scales, kept_scales),
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

    def write(array: jax.Array, rows: jax.Array) -> jax.Array:
        return write_token(array, rows, positions, split=split)

    layer = pf.DecodeCache(cache.k, cache.v, None, cache.k_scales, cache.v_scales)
    layer = write_kv(layer, k_new, v_new, write)
    lengths = cache.lengths + room.astype(jnp.int32)
    return KVCache(layer.k, layer.v, lengths, layer.k_scales, layer.v_scales)
