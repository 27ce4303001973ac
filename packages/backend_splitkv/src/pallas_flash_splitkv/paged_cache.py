"""`PagedKVCache`: a pool of cache pages shared by a batch of sequences, with a page table,
page allocation and release on the device, and an in-place append.

Layouts (`pf.DecodeCache`): pages ``[num_pages, kv_heads, page_size, head_dim]``, in q's
dtype or int8 with float32 scales ``[num_pages, kv_heads, page_size]``; ``page_table [batch,
pages_per_sequence]`` int32, -1 where no page is held; ``lengths [batch]``.

Free pages are a stack, ``free_pages[:num_free]``. An append gives each sequence whose length
is a multiple of ``page_size`` (its pages are full, or it has none) the next free page,
vectorised over the batch (a sequence's rank among those needing a page picks its stack slot),
then writes every sequence's new K/V row, quantized when the pool is int8, with one
``dynamic_update_slice`` per sequence (`pallas_flash.cache_write.write_rows`; a scatter would
re-lay-out a copy of the whole pool on TPU).
`release` pushes a finished sequence's pages back. Everything runs in jitted functions that
donate the cache and return it row-major (`pf.kept_format`), so appends and releases update
the pool in place and a generation loop can call them inside its own jit.
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
from pallas_flash.cache_write import write_rows
from pallas_flash_splitkv.cache import check_room, check_token_shapes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """A paged KV cache and its allocator (layouts in the module doc).

    Attributes:
      k, v: the page pool ``[num_pages, kv_heads, page_size, head_dim]``.
      k_scales, v_scales: ``[num_pages, kv_heads, page_size]`` float32 for an int8 pool,
        else None.
      page_table: ``[batch, pages_per_sequence]`` int32; -1: no page.
      lengths: ``[batch]`` int32.
      free_pages: ``[num_pages]`` int32; the first ``num_free`` are the free pages.
      num_free: int32 scalar.
    """

    k: jax.Array
    v: jax.Array
    k_scales: jax.Array | None
    v_scales: jax.Array | None
    page_table: jax.Array
    lengths: jax.Array
    free_pages: jax.Array
    num_free: jax.Array

    @classmethod
    def empty(
        cls,
        batch: int,
        pages_per_sequence: int,
        num_pages: int,
        kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.bfloat16,
    ) -> PagedKVCache:
        """An empty cache: every page free, every sequence of length 0.

        Args:
          pages_per_sequence: the most pages one sequence may hold (its longest length is
            ``pages_per_sequence * page_size``).
          num_pages: pages in the pool, shared by all sequences.
          dtype: of the pages: q's dtype, or ``jnp.int8`` (then with scales).
        """
        shape = (num_pages, kv_heads, page_size, head_dim)
        quantized = jnp.dtype(dtype) == jnp.int8
        scales = (lambda: pf.zeros_cache(shape[:3], jnp.float32)) if quantized else lambda: None
        return cls(
            k=pf.zeros_cache(shape, dtype),
            v=pf.zeros_cache(shape, dtype),
            k_scales=scales(),
            v_scales=scales(),
            page_table=jnp.full((batch, pages_per_sequence), -1, jnp.int32),
            lengths=jnp.zeros((batch,), jnp.int32),
            free_pages=jnp.arange(num_pages, dtype=jnp.int32)[::-1],  # page 0 on top
            num_free=jnp.asarray(num_pages, jnp.int32),
        )

    @property
    def page_size(self) -> int:
        """Positions per page."""
        return self.k.shape[2]

    @property
    def max_len(self) -> int:
        """The longest sequence: ``pages_per_sequence * page_size``."""
        return self.page_table.shape[1] * self.page_size

    def append(
        self, k_new: jax.Array, v_new: jax.Array, active: jax.Array | None = None
    ) -> PagedKVCache:
        """The cache with one more token for every ``active`` sequence, written in place.

        This cache's buffers are donated: use only the returned one. Outside a trace, a
        sequence that is full or would need a page when none is free raises; under a trace it
        is left unchanged (check ``lengths``).

        Args:
          k_new: ``[batch, kv_heads, head_dim]``, the new token's keys.
          v_new: ``[batch, kv_heads, head_dim]``, its values.
          active: ``[batch]`` bool, the sequences to extend; default all.

        Raises:
          pf.InvalidInputError: a shape does not match, a sequence is full, or the pool has
            too few free pages (concrete values only).
        """
        batch = self.page_table.shape[0]
        check_token_shapes(k_new, v_new, (batch, self.k.shape[1], self.k.shape[3]))
        active = jnp.ones((batch,), bool) if active is None else jnp.asarray(active, bool)
        if not isinstance(self.lengths, jax.core.Tracer):
            self._check_room(np.asarray(active))
        return _append_step(pf.kept_format(self.k), _kept(self.k_scales))(
            self, k_new, v_new, active
        )

    def _check_room(self, active: np.ndarray) -> None:
        lengths = np.asarray(self.lengths)
        check_room(lengths, self.max_len, active)
        needed = int((active & (lengths % self.page_size == 0)).sum())
        if needed > int(self.num_free):
            raise pf.InvalidInputError(
                f"num_free: expected {needed} free pages for this append, got {int(self.num_free)}"
            )

    def release(self, done: jax.Array) -> PagedKVCache:
        """The cache with the ``done`` sequences' pages freed and their lengths 0, in place.

        Args:
          done: ``[batch]`` bool.
        """
        done = jnp.asarray(done, bool)
        return _release_step(pf.kept_format(self.k), _kept(self.k_scales))(self, done)

    def decode(self, q: jax.Array, **kwargs: object) -> jax.Array:
        """``pf.decode`` of ``q [batch, q_heads, head_dim]`` against this cache."""
        return pf.decode(
            q, self.k, self.v, self.lengths, page_table=self.page_table,
            k_scales=self.k_scales, v_scales=self.v_scales, **kwargs,
        )  # fmt: skip


def _kept(scales: jax.Array | None) -> Format | None:
    return None if scales is None else pf.kept_format(scales)


def _out_shardings(kept: Format | None, kept_scales: Format | None) -> PagedKVCache:
    return PagedKVCache(kept, kept, kept_scales, kept_scales, None, None, None, None)


@functools.cache
def _append_step(
    kept: Format | None, kept_scales: Format | None
) -> Callable[[PagedKVCache, jax.Array, jax.Array, jax.Array], PagedKVCache]:
    """`PagedKVCache.append` without the checks, jitted with the cache donated and returned
    in the given formats (None: traced, the enclosing jit decides)."""
    return jax.jit(_append, donate_argnums=0, out_shardings=_out_shardings(kept, kept_scales))


@functools.cache
def _release_step(
    kept: Format | None, kept_scales: Format | None
) -> Callable[[PagedKVCache, jax.Array], PagedKVCache]:
    return jax.jit(_release, donate_argnums=0, out_shardings=_out_shardings(kept, kept_scales))


def _append(
    cache: PagedKVCache, k_new: jax.Array, v_new: jax.Array, active: jax.Array
) -> PagedKVCache:
    """Allocates the pages the active sequences need, then writes their rows."""
    num_pages, page_size = cache.k.shape[0], cache.page_size
    lengths = cache.lengths
    active = active & (lengths < cache.max_len)
    needs = active & (lengths % page_size == 0)
    rank = jnp.cumsum(needs) - 1  # the sequence's place among those needing a page
    granted = needs & (rank < cache.num_free)
    active = active & (granted | ~needs)  # no page to be had: the sequence waits
    slot = jnp.clip(cache.num_free - 1 - rank, 0, num_pages - 1)
    new_page = cache.free_pages[slot]
    batch = jnp.arange(lengths.shape[0])
    index = lengths // page_size
    table = cache.page_table.at[batch, jnp.where(granted, index, cache.max_len)].set(
        new_page, mode="drop"
    )
    page = jnp.where(active, table[batch, jnp.minimum(index, table.shape[1] - 1)], num_pages)
    row = lengths % page_size

    def write(pool: jax.Array, values: jax.Array) -> jax.Array:  # page num_pages: no write
        return write_rows(pool, values, page, row)

    if cache.k_scales is None:
        k, v, k_scales, v_scales = write(cache.k, k_new), write(cache.v, v_new), None, None
    else:
        (k8, ks), (v8, vs) = pf.quantize_int8(k_new), pf.quantize_int8(v_new)
        k, v = write(cache.k, k8), write(cache.v, v8)
        k_scales, v_scales = write(cache.k_scales, ks), write(cache.v_scales, vs)
    return PagedKVCache(
        k, v, k_scales, v_scales, table,
        lengths + active.astype(jnp.int32),
        cache.free_pages,
        cache.num_free - granted.sum(dtype=jnp.int32),
    )  # fmt: skip


def _release(cache: PagedKVCache, done: jax.Array) -> PagedKVCache:
    """Pushes the ``done`` sequences' pages onto the free stack, in table order."""
    held = (cache.page_table >= 0) & done[:, None]  # [batch, pages_per_sequence]
    flat_held = held.reshape(-1)
    rank = jnp.cumsum(flat_held) - 1
    num_pages = cache.free_pages.shape[0]
    slot = jnp.where(flat_held, cache.num_free + rank, num_pages)  # past the end: dropped
    free_pages = cache.free_pages.at[slot].set(cache.page_table.reshape(-1), mode="drop")
    return dataclasses.replace(
        cache,
        page_table=jnp.where(done[:, None], -1, cache.page_table),
        lengths=jnp.where(done, 0, cache.lengths),
        free_pages=free_pages,
        num_free=cache.num_free + flat_held.sum(dtype=jnp.int32),
    )
