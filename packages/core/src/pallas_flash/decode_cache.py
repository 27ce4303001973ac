"""`DecodeCache`: the KV cache one decode call reads, contiguous or paged, float or int8.

Layouts (``kv_heads`` before positions in both, so one kv head's run of positions is
contiguous in HBM and a kernel reads it with one strided DMA):

- contiguous: ``k, v [batch, kv_heads, max_len, head_dim]``;
- paged: ``k, v [num_pages, kv_heads, page_size, head_dim]`` and ``page_table [batch,
  pages_per_sequence]`` int32: position ``p`` of sequence ``b`` is row ``p % page_size`` of
  page ``page_table[b, p // page_size]``. A page holds ``page_size`` positions of every kv
  head, so a sequence's next page is one contiguous read whatever the number of heads.

An int8 cache (``k`` and ``v`` int8) carries float32 scales of the cache's shape without
``head_dim``, one per token and kv head (`pallas_flash.quantization`): its values are
``k * k_scales[..., None]``.

A 16-bit paged cache may be *packed* (`pallas_flash.kv_packing`): ``k`` one uint32 pool
``[num_pages, kv_heads, page_size, head_dim]`` holding each position's key and value in one
word, ``v`` None; its values are q's dtype. One new token is then written alone, not with
the tile of 16 positions around it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_flash.kv_packing import unpack_kv


class DecodeCache(NamedTuple):
    """The cache of a decode call, validated by ``pf.decode`` (a pytree; None fields are
    absent).

    Attributes:
      k, v: contiguous or paged (module doc), q's dtype, or int8 with scales; or, packed,
        ``k`` the uint32 pool of both and ``v`` None.
      page_table: ``[batch, pages_per_sequence]`` int32 for a paged cache, else None.
      k_scales, v_scales: float32, ``k``'s shape without ``head_dim``, for an int8 cache.
    """

    k: jax.Array
    v: jax.Array | None
    page_table: jax.Array | None = None
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None

    @property
    def paged(self) -> bool:
        """Whether the cache is in pages read through ``page_table``."""
        return self.page_table is not None

    @property
    def packed(self) -> bool:
        """Whether ``k`` holds keys and values packed in 32-bit words (module doc)."""
        return self.v is None

    def unpacked(self, dtype: jnp.dtype) -> DecodeCache:
        """The cache with its keys and values in arrays of their own, of ``dtype`` (q's)
        where packed; itself otherwise."""
        if not self.packed:
            return self
        k, v = unpack_kv(self.k, dtype)
        return self._replace(k=k, v=v)

    @property
    def quantized(self) -> bool:
        """Whether the cache is int8 with scales."""
        return self.k_scales is not None

    @property
    def max_len(self) -> int:
        """Positions one sequence can hold."""
        if self.paged:
            return self.page_table.shape[1] * self.k.shape[2]
        return self.k.shape[2]
