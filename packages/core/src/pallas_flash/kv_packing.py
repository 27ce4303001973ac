"""A 16-bit paged cache packed in 32-bit words: ``uint32 [num_pages, kv_heads, page_size,
head_dim]``, each word a position's key (its low 16 bits) and value (its high 16 bits) at one
``head_dim`` lane.

Why: a pool of 16-bit values keeps two positions in each 32-bit word of its HBM tiles
(``T(8,128)(2,1)``, positions on sublanes), so a copy cannot write one new token's row alone:
the page write reads and rewrites whole tiles of 16 positions around it
(`pallas_flash.page_write_kernel`). Packed, one kv head's position is one row of 32-bit words
(512 bytes at ``head_dim`` 128), a sublane of its tile, which a DMA writes alone: a decode
step moves just its new tokens' bytes. A kernel reads one array instead of two (one copy a
page) and unpacks each word with a shift and a truncation on the VPU (`unpack_kv`).
tpu-inference's RPA v3 packs its cache the same way (keys and values interleaved along its
heads, ``T(2,128)(2,1)``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

PACKED_DTYPE = jnp.dtype(jnp.uint32)
"""The dtype of a packed cache."""


def packable(dtype: jnp.dtype) -> bool:
    """Whether a cache of ``dtype`` packs: a 16-bit float (bfloat16 or float16)."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2


def pack_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """``k`` and ``v`` (one shape, one 16-bit float dtype) as one uint32 array of that shape:
    each word ``k``'s bits in its low half, ``v``'s in its high half."""

    def bits(x: jax.Array) -> jax.Array:
        return lax.bitcast_convert_type(x, jnp.uint16).astype(PACKED_DTYPE)

    return bits(k) | (bits(v) << 16)


def unpack_kv(words: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """The keys and values of ``words`` (`pack_kv`) in their 16-bit float ``dtype``, each of
    ``words``' shape."""
    k = lax.bitcast_convert_type(words.astype(jnp.uint16), dtype)
    v = lax.bitcast_convert_type((words >> 16).astype(jnp.uint16), dtype)
    return k, v
