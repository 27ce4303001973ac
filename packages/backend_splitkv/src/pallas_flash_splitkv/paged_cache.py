"""`PagedKVCache`: a pool of cache pages shared by a batch of sequences, with a page table,
page allocation and release on the device, and an in-place append.

Layouts (`pf.DecodeCache`): pages ``[num_pages, kv_heads, page_size, head_dim]``, in q's
dtype or int8 with float32 scales ``[num_pages, kv_heads, page_size]``; ``page_table [batch,
pages_per_sequence]`` int32, -1 where no page is held; ``lengths [batch]``.

The pool may be split along its pages over a mesh (``sharding=``): ``shards`` devices, each
holding ``num_pages / shards`` consecutive pages (one shard without a mesh). Each shard's free
pages are a stack, ``free_pages[s, :num_free[s]]``. An append gives each sequence whose length
is a multiple of ``page_size`` (its pages are full, or it has none) the next free page of
shard ``(j + b) % shards`` for its page ``j`` (sequence ``b``): a sequence's pages go round the
shards, so a decode over the mesh (`page_shards`) gives every device about ``1 / shards`` of
every sequence, whatever the lengths. Allocation is vectorised over the batch (a sequence's
rank among those needing a page of the same shard picks its stack slot); a sequence whose
shard has no free page waits. Then every sequence's new K/V row is written, quantized when the
pool is int8, with one ``dynamic_update_slice`` per sequence, each by the device holding its
page (`pallas_flash.cache_write.write_rows`; a scatter would re-lay-out a copy of the whole
pool on TPU). `release` pushes a finished sequence's pages back onto their shards' stacks.
Everything runs in jitted functions that donate the cache and return it row-major
(`pf.kept_format`), so appends and releases update the pool in place and a generation loop
can call them inside its own jit.
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
from pallas_flash.cache_write import write_rows
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
        if num_pages % shards:
            raise pf.InvalidInputError(
                f"num_pages: expected a multiple of the {shards} shards of sharding, "
                f"got {num_pages}"
            )
        quantized = jnp.dtype(dtype) == jnp.int8
        scales = placement.drop_last_axis(sharding)

        def zero_scales() -> jax.Array | None:
            return pf.zeros_cache(shape[:3], jnp.float32, scales) if quantized else None

        per_shard = num_pages // shards
        starts = jnp.arange(shards, dtype=jnp.int32)[:, None] * per_shard
        return cls(
            k=k,
            v=pf.zeros_cache(shape, dtype, sharding),
            k_scales=zero_scales(),
            v_scales=zero_scales(),
            page_table=jnp.full((batch, pages_per_sequence), -1, jnp.int32),
            lengths=jnp.zeros((batch,), jnp.int32),
            free_pages=starts + jnp.arange(per_shard, dtype=jnp.int32)[::-1],  # lowest on top
            num_free=jnp.full((shards,), per_shard, jnp.int32),
        )

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
        needs = active & (lengths % self.page_size == 0)
        shard = _shard_of_next_page(lengths, self.page_size, self.shards)
        needed = np.bincount(shard[needs], minlength=self.shards)
        free = np.asarray(self.num_free)
        short = np.flatnonzero(needed > free)
        if short.size:
            s = int(short[0])
            where = f" of shard {s}" if self.shards > 1 else ""
            raise pf.InvalidInputError(
                f"num_free: expected {needed[s]} free pages{where} for this append, got {free[s]}"
            )

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


def _shard_of_next_page(lengths, page_size: int, shards: int):
    """``[batch]``: the shard a sequence's next page comes from, ``(j + b) % shards`` for its
    page ``j = lengths // page_size`` (numpy or jax arrays alike)."""
    return (lengths // page_size + np.arange(lengths.shape[0])) % shards


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


def _rank_within_shard(wants: jax.Array, shard: jax.Array, shards: int) -> jax.Array:
    """``[n]``: each entry's place among the ``wants`` entries before it with its ``shard``."""
    same = wants[:, None] & (shard[:, None] == jnp.arange(shards))  # [n, shards]
    return jnp.take_along_axis(jnp.cumsum(same, axis=0), shard[:, None], axis=1)[:, 0] - 1


def _append(
    cache: PagedKVCache,
    k_new: jax.Array,
    v_new: jax.Array,
    active: jax.Array,
    split: placement.Split | None,
) -> PagedKVCache:
    """Allocates the pages the active sequences need, then writes their rows."""
    num_pages, page_size, shards = cache.k.shape[0], cache.page_size, cache.shards
    per_shard = cache.free_pages.shape[1]
    lengths = cache.lengths
    active = active & (lengths < cache.max_len)
    needs = active & (lengths % page_size == 0)
    shard = _shard_of_next_page(lengths, page_size, shards)
    rank = _rank_within_shard(needs, shard, shards)
    free = cache.num_free[shard]
    granted = needs & (rank < free)
    active = active & (granted | ~needs)  # no page to be had: the sequence waits
    new_page = cache.free_pages[shard, jnp.clip(free - 1 - rank, 0, per_shard - 1)]
    batch = jnp.arange(lengths.shape[0])
    index = lengths // page_size
    table = cache.page_table.at[batch, jnp.where(granted, index, cache.max_len)].set(
        new_page, mode="drop"
    )
    page = jnp.where(active, table[batch, jnp.minimum(index, table.shape[1] - 1)], num_pages)
    row = lengths % page_size

    def write(pool: jax.Array, values: jax.Array) -> jax.Array:  # page num_pages: no write
        return write_rows(pool, values, page, row, split=split, split_axis=placement.PAGE_AXIS)

    if cache.k_scales is None:
        k, v, k_scales, v_scales = write(cache.k, k_new), write(cache.v, v_new), None, None
    else:
        (k8, ks), (v8, vs) = pf.quantize_int8(k_new), pf.quantize_int8(v_new)
        k, v = write(cache.k, k8), write(cache.v, v8)
        k_scales, v_scales = write(cache.k_scales, ks), write(cache.v_scales, vs)
    taken = jnp.zeros((shards,), jnp.int32).at[shard].add(granted.astype(jnp.int32))
    return PagedKVCache(
        k, v, k_scales, v_scales, table,
        lengths + active.astype(jnp.int32),
        cache.free_pages,
        cache.num_free - taken,
    )  # fmt: skip


def _release(cache: PagedKVCache, done: jax.Array) -> PagedKVCache:
    """Pushes the ``done`` sequences' pages onto their shards' free stacks, in table order."""
    shards, per_shard = cache.free_pages.shape
    pages = cache.page_table.reshape(-1)
    held = ((cache.page_table >= 0) & done[:, None]).reshape(-1)
    shard = jnp.clip(pages // per_shard, 0, shards - 1)
    slot = cache.num_free[shard] + _rank_within_shard(held, shard, shards)
    free_pages = cache.free_pages.at[shard, jnp.where(held, slot, per_shard)].set(
        pages, mode="drop"
    )  # a slot past the end: dropped
    returned = jnp.zeros((shards,), jnp.int32).at[shard].add(held.astype(jnp.int32))
    return dataclasses.replace(
        cache,
        page_table=jnp.where(done[:, None], -1, cache.page_table),
        lengths=jnp.where(done, 0, cache.lengths),
        free_pages=free_pages,
        num_free=cache.num_free + returned,
    )
