"""`PagedKVCache`: a pool of cache pages shared by a batch of sequences, with a page table,
page allocation and release on the device, and an in-place append.

Layouts (`pf.DecodeCache`): pages ``[num_pages, kv_heads, page_size, head_dim]``, in q's
dtype or int8 with float32 scales ``[num_pages, kv_heads, page_size]``; ``page_table [batch,
pages_per_sequence]`` int32, -1 where no page is held; ``lengths [batch]``.

The pool may be split along its pages over a mesh (``sharding=``): ``shards`` devices, each
holding ``num_pages / shards`` consecutive pages (one shard without a mesh). The page table
and the free pages are core's `pallas_flash.page_allocator` (this cache holds its arrays as
fields): an append gives each sequence whose length is a multiple of ``page_size`` (its pages
are full, or it has none) the next free page of shard ``(j + b) % shards`` for its page ``j``
(sequence ``b``), so a decode over the mesh (`page_shards`) gives every device about ``1 /
shards`` of every sequence, whatever the lengths; a sequence whose shard has no free page
waits. Then every sequence's new K/V row is written, quantized when the pool is int8
(`pallas_flash.cache_write.write_kv`), each by the device holding its page
(`pallas_flash.cache_write.write_rows`: every sequence writes into a page of its own, so on
TPU one row-write kernel a pool, elsewhere a ``dynamic_update_slice`` per sequence; a scatter
would re-lay-out a copy of the whole pool on TPU). `release` pushes a finished sequence's pages back
onto their shards' stacks. Everything runs in jitted functions that donate the cache and
return it row-major (`pf.kept_format`), so appends and releases update the pool in place and
a generation loop can call them inside its own jit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format

import pallas_flash as pf
from pallas_flash import page_allocator
from pallas_flash.cache_write import write_kv, write_rows
from pallas_flash_splitkv import placement
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
      free_pages: ``[shards, num_pages / shards]`` int32; row ``s`` holds shard ``s``'s free
        pages (global indices), the first ``num_free[s]`` of them.
      num_free: ``[shards]`` int32.
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
        sharding: jax.sharding.Sharding | None = None,
    ) -> PagedKVCache:
        """An empty cache: every page free, every sequence of length 0.

        Args:
          pages_per_sequence: the most pages one sequence may hold (its longest length is
            ``pages_per_sequence * page_size``).
          num_pages: pages in the pool, shared by all sequences.
          dtype: of the pages: q's dtype, or ``jnp.int8`` (then with scales).
          sharding: placement of the pool (scales alike), e.g. ``NamedSharding(mesh,
            P("kv"))`` to split its pages over a mesh, which `decode` then follows.

        Raises:
          pf.InvalidInputError: ``sharding`` splits the pool along another axis than its
            pages, or into shards that do not divide ``num_pages``.
        """
        shape = (num_pages, kv_heads, page_size, head_dim)
        k = pf.zeros_cache(shape, dtype, sharding)
        split = placement.follow(k, k, placement.PAGE_AXIS)
        shards = 1 if split is None else math.prod(split[0].shape[a] for a in split[1])
        pages = pf.PageAllocator.empty(batch, pages_per_sequence, num_pages, shards)
        quantized = jnp.dtype(dtype) == jnp.int8
        scales = placement.drop_last_axis(sharding)

        def zero_scales() -> jax.Array | None:
            return pf.zeros_cache(shape[:3], jnp.float32, scales) if quantized else None

        return cls(
            k=k,
            v=pf.zeros_cache(shape, dtype, sharding),
            k_scales=zero_scales(),
            v_scales=zero_scales(),
            page_table=pages.page_table,
            lengths=jnp.zeros((batch,), jnp.int32),
            free_pages=pages.free_pages,
            num_free=pages.num_free,
        )

    @property
    def pages(self) -> pf.PageAllocator:
        """The page table and free pages, as core's allocator."""
        return pf.PageAllocator(self.page_table, self.free_pages, self.num_free)

    @property
    def page_size(self) -> int:
        """Positions per page."""
        return self.k.shape[2]

    @property
    def max_len(self) -> int:
        """The longest sequence: ``pages_per_sequence * page_size``."""
        return self.page_table.shape[1] * self.page_size

    @property
    def shards(self) -> int:
        """Parts the pool is split into along its pages (devices of its mesh; 1 without)."""
        return self.free_pages.shape[0]

    def append(
        self, k_new: jax.Array, v_new: jax.Array, active: jax.Array | None = None
    ) -> PagedKVCache:
        """The cache with one more token for every ``active`` sequence, written in place.

        This cache's buffers are donated: use only the returned one. Outside a trace, a
        sequence that is full or would need a page when its shard has none free raises;
        under a trace it is left unchanged (check ``lengths``). A pool split over a mesh is
        written by each device in its own pages; under a trace its sharding is unknown and
        the write is left to XLA's partitioner, so call ``append`` outside ``jit`` there.

        Args:
          k_new: ``[batch, kv_heads, head_dim]``, the new token's keys.
          v_new: ``[batch, kv_heads, head_dim]``, its values.
          active: ``[batch]`` bool, the sequences to extend; default all.

        Raises:
          pf.InvalidInputError: a shape does not match, a sequence is full, or a shard has
            too few free pages (concrete values only).
        """
        batch = self.page_table.shape[0]
        check_token_shapes(k_new, v_new, (batch, self.k.shape[1], self.k.shape[3]))
        active = jnp.ones((batch,), bool) if active is None else jnp.asarray(active, bool)
        if not isinstance(self.lengths, jax.core.Tracer):
            self._check_room(np.asarray(active))
        split = placement.axis_split(self.k, placement.PAGE_AXIS)
        return _append_step(pf.kept_format(self.k), _kept(self.k_scales), split)(
            self, k_new, v_new, active
        )

    def _check_room(self, active: np.ndarray) -> None:
        lengths = np.asarray(self.lengths)
        check_room(lengths, self.max_len, active)
        page_allocator.check_free_pages(np.asarray(self.num_free), lengths, self.page_size, active)

    def release(self, done: jax.Array) -> PagedKVCache:
        """The cache with the ``done`` sequences' pages freed and their lengths 0, in place.

        Args:
          done: ``[batch]`` bool.
        """
        done = jnp.asarray(done, bool)
        return _release_step(pf.kept_format(self.k), _kept(self.k_scales))(self, done)

    def decode(self, q: jax.Array, **kwargs: object) -> jax.Array:
        """``pf.decode`` of ``q [batch, q_heads, head_dim]`` against this cache (over the
        pool's mesh when it is split)."""
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
    kept: Format | None, kept_scales: Format | None, split: placement.Split | None
) -> Callable[[PagedKVCache, jax.Array, jax.Array, jax.Array], PagedKVCache]:
    """`PagedKVCache.append` without the checks, jitted with the cache donated and returned
    in the given formats (None: traced, the enclosing jit decides); ``split``: the mesh axes
    that split the pool's pages (each device writes its own pages' rows)."""
    return jax.jit(
        functools.partial(_append, split=split),
        donate_argnums=0,
        out_shardings=_out_shardings(kept, kept_scales),
    )


@functools.cache
def _release_step(
    kept: Format | None, kept_scales: Format | None
) -> Callable[[PagedKVCache, jax.Array], PagedKVCache]:
    return jax.jit(_release, donate_argnums=0, out_shardings=_out_shardings(kept, kept_scales))


def _with_pages(cache: PagedKVCache, pages: pf.PageAllocator, **changes) -> PagedKVCache:
    return dataclasses.replace(
        cache,
        page_table=pages.page_table,
        free_pages=pages.free_pages,
        num_free=pages.num_free,
        **changes,
    )


def _append(
    cache: PagedKVCache,
    k_new: jax.Array,
    v_new: jax.Array,
    active: jax.Array,
    split: placement.Split | None,
) -> PagedKVCache:
    """Allocates the pages the active sequences need, then writes their rows."""
    pages, page, active = page_allocator.allocate_next(
        cache.pages, cache.lengths, active, cache.page_size
    )
    row = cache.lengths % cache.page_size

    def write(pool: jax.Array, values: jax.Array) -> jax.Array:  # page -1: no write
        return write_rows(
            pool, values, page, row, split=split, split_axis=placement.PAGE_AXIS,
            distinct_blocks=True,  # each sequence writes into its own last page
        )  # fmt: skip

    layer = pf.DecodeCache(cache.k, cache.v, None, cache.k_scales, cache.v_scales)
    layer = write_kv(layer, k_new, v_new, write)
    return _with_pages(
        cache, pages,
        k=layer.k, v=layer.v, k_scales=layer.k_scales, v_scales=layer.v_scales,
        lengths=cache.lengths + active.astype(jnp.int32),
    )  # fmt: skip


def _release(cache: PagedKVCache, done: jax.Array) -> PagedKVCache:
    """Pushes the ``done`` sequences' pages onto their shards' free stacks, in table order."""
    pages = page_allocator.release(cache.pages, done)
    return _with_pages(cache, pages, lengths=jnp.where(done, 0, cache.lengths))
