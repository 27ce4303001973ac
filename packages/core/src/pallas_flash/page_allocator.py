"""`PageAllocator`: the page table of a paged KV cache and its free pages, allocated and
released on the device by pure jax functions.

State: ``page_table [batch, pages_per_sequence]`` int32, the pool's page holding positions
``[j, j + 1) x page_size`` of sequence ``b`` at ``[b, j]``, -1 where no page is held;
``free_pages [shards, num_pages / shards]`` int32 and ``num_free [shards]`` int32. A pool
split along its pages over ``shards`` devices holds pages ``[s, s + 1) x num_pages / shards``
on shard ``s`` (one shard without a mesh); each shard's free pages are a stack,
``free_pages[s, :num_free[s]]``, the lowest page on top when empty.

Page ``j`` of sequence ``b`` comes from shard ``(j + b) % shards`` (`shard_of_page`): a
sequence's pages go round the shards, so a decode over the mesh gives every device about
``1 / shards`` of every sequence, whatever the lengths. `allocate` is vectorised over the
table: each wanted slot's rank among the wanted slots of its shard (in row-major table
order) picks its place on that shard's stack, and a slot whose shard has too few free pages
is not granted. `allocate_next` (one more token: a page for each sequence whose pages are
full or that has none) and `allocate_prompts` (``ceil(length / page_size)`` pages per
sequence) build on it; `release` pushes sequences' pages back. The functions neither read nor
write the pool itself: a cache that holds a `PageAllocator` jits them with its pool donated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash.errors import InvalidInputError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageAllocator:
    """Which pages of a pool each sequence holds, and which are free (module doc).

    Attributes:
      page_table: ``[batch, pages_per_sequence]`` int32; -1: no page.
      free_pages: ``[shards, num_pages / shards]`` int32; row ``s`` holds shard ``s``'s free
        pages (global indices), the first ``num_free[s]`` of them.
      num_free: ``[shards]`` int32.
    """

    page_table: jax.Array
    free_pages: jax.Array
    num_free: jax.Array

    @classmethod
    def empty(
        cls, batch: int, pages_per_sequence: int, num_pages: int, shards: int = 1
    ) -> PageAllocator:
        """No page held, every page free.

        Args:
          batch: sequences.
          pages_per_sequence: the most pages one sequence may hold.
          num_pages: pages in the pool.
          shards: parts the pool is split into along its pages (devices of its mesh).

        Raises:
          InvalidInputError: ``shards`` does not divide ``num_pages``.
        """
        if num_pages % shards:
            raise InvalidInputError(
                f"num_pages: expected a multiple of the {shards} shards of the pool, "
                f"got {num_pages}"
            )
        per_shard = num_pages // shards
        starts = jnp.arange(shards, dtype=jnp.int32)[:, None] * per_shard
        return cls(
            page_table=jnp.full((batch, pages_per_sequence), -1, jnp.int32),
            free_pages=starts + jnp.arange(per_shard, dtype=jnp.int32)[::-1],  # lowest on top
            num_free=jnp.full((shards,), per_shard, jnp.int32),
        )

    @property
    def shards(self) -> int:
        """Parts the pool is split into along its pages (1 without a mesh)."""
        return self.free_pages.shape[0]

    @property
    def pages_per_sequence(self) -> int:
        """The most pages one sequence may hold."""
        return self.page_table.shape[1]


def shard_of_page(index, sequence, shards: int):
    """The shard that page ``index`` of ``sequence`` comes from, ``(index + sequence) %
    shards`` (numpy or jax arrays alike, broadcast)."""
    return (index + sequence) % shards


def shard_of_next_page(lengths, page_size: int, shards: int):
    """``[batch]``: the shard each sequence's next page comes from, for its page
    ``lengths // page_size`` (numpy or jax arrays alike)."""
    return shard_of_page(lengths // page_size, np.arange(lengths.shape[0]), shards)


def _rank_within_shard(wants: jax.Array, shard: jax.Array, shards: int) -> jax.Array:
    """``[n]``: each entry's place among the ``wants`` entries before it with its ``shard``."""
    same = wants[:, None] & (shard[:, None] == jnp.arange(shards))  # [n, shards]
    return jnp.take_along_axis(jnp.cumsum(same, axis=0), shard[:, None], axis=1)[:, 0] - 1


def allocate(pages: PageAllocator, wants: jax.Array) -> tuple[PageAllocator, jax.Array]:
    """Gives each wanted table slot the next free page of its shard.

    Args:
      pages: the allocator.
      wants: ``[batch, pages_per_sequence]`` bool, slots that hold no page and need one.

    Returns:
      The allocator with the granted pages in its table and off its stacks, and ``granted``
      (``wants`` less the slots whose shard ran out of free pages).
    """
    (shards, per_shard), (batch, width) = pages.free_pages.shape, pages.page_table.shape
    shard = shard_of_page(jnp.arange(width)[None, :], jnp.arange(batch)[:, None], shards)
    wants, shard = wants.reshape(-1), shard.reshape(-1)
    rank = _rank_within_shard(wants, shard, shards)
    free = pages.num_free[shard]
    granted = wants & (rank < free)
    page = pages.free_pages[shard, jnp.clip(free - 1 - rank, 0, per_shard - 1)]
    table = jnp.where(granted, page, pages.page_table.reshape(-1)).reshape(batch, width)
    taken = jnp.zeros((shards,), jnp.int32).at[shard].add(granted.astype(jnp.int32))
    allocator = PageAllocator(table, pages.free_pages, pages.num_free - taken)
    return allocator, granted.reshape(batch, width)


def allocate_next(
    pages: PageAllocator, lengths: jax.Array, active: jax.Array, page_size: int
) -> tuple[PageAllocator, jax.Array, jax.Array]:
    """Makes room for one more token of every ``active`` sequence: a page for each whose
    length is a multiple of ``page_size`` (its pages are full, or it has none).

    Args:
      pages: the allocator.
      lengths: ``[batch]`` int32 tokens cached per sequence.
      active: ``[batch]`` bool, the sequences to extend.
      page_size: positions per page.

    Returns:
      The allocator; ``page [batch]`` int32, the page holding position ``lengths[b]`` (whose
      row is ``lengths[b] % page_size``), -1 where a sequence is not extended; and the
      sequences extended: ``active`` less those that are full or whose shard has no free
      page (they wait).
    """
    width = pages.pages_per_sequence
    index = lengths // page_size
    active = active & (index < width)
    needs = active & (lengths % page_size == 0)
    wants = needs[:, None] & (jnp.arange(width)[None, :] == index[:, None])
    pages, granted = allocate(pages, wants)
    active = active & (granted.any(axis=1) | ~needs)
    at = jnp.minimum(index, width - 1)[:, None]
    page = jnp.take_along_axis(pages.page_table, at, axis=1)[:, 0]
    return pages, jnp.where(active, page, -1), active


def allocate_prompts(
    pages: PageAllocator, lengths: jax.Array, page_size: int
) -> tuple[PageAllocator, jax.Array]:
    """Gives each sequence the pages that ``lengths[b]`` positions take, ``ceil(lengths[b] /
    page_size)``, keeping the pages it holds.

    Args:
      pages: the allocator.
      lengths: ``[batch]`` int32.
      page_size: positions per page.

    Returns:
      The allocator and ``granted [batch, pages_per_sequence]`` bool, the slots given a page
      (a slot whose shard ran out of free pages stays -1).
    """
    needed = -(-lengths // page_size)  # ceil division
    held = jnp.arange(pages.pages_per_sequence)[None, :] < needed[:, None]
    return allocate(pages, held & (pages.page_table < 0))


def release(pages: PageAllocator, done: jax.Array) -> PageAllocator:
    """Pushes the ``done`` sequences' pages onto their shards' free stacks, in table order,
    and clears their rows of the table (their lengths are the caller's to reset).

    Args:
      pages: the allocator.
      done: ``[batch]`` bool.
    """
    shards, per_shard = pages.free_pages.shape
    table = pages.page_table.reshape(-1)
    held = ((pages.page_table >= 0) & done[:, None]).reshape(-1)
    shard = jnp.clip(table // per_shard, 0, shards - 1)
    slot = pages.num_free[shard] + _rank_within_shard(held, shard, shards)
    free_pages = pages.free_pages.at[shard, jnp.where(held, slot, per_shard)].set(
        table, mode="drop"
    )  # a slot past the end: dropped
    returned = jnp.zeros((shards,), jnp.int32).at[shard].add(held.astype(jnp.int32))
    return PageAllocator(
        jnp.where(done[:, None], -1, pages.page_table), free_pages, pages.num_free + returned
    )


def check_free_pages(
    num_free: np.ndarray, lengths: np.ndarray, page_size: int, active: np.ndarray
) -> None:
    """Checks, on concrete values, that every shard has a free page for each ``active``
    sequence that `allocate_next` would give one.

    Args:
      num_free: ``[shards]``, free pages per shard.
      lengths: ``[batch]``, tokens cached per sequence.
      page_size: positions per page.
      active: ``[batch]`` bool, the sequences to extend.

    Raises:
      InvalidInputError: naming ``num_free``, the shard short of pages and how many it needs.
    """
    shards = num_free.shape[0]
    needs = active & (lengths % page_size == 0)
    needed = np.bincount(shard_of_next_page(lengths, page_size, shards)[needs], minlength=shards)
    short = np.flatnonzero(needed > num_free)
    if short.size:
        s = int(short[0])
        where = f" of shard {s}" if shards > 1 else ""
        raise InvalidInputError(
            f"num_free: expected {needed[s]} free pages{where} for this append, got {num_free[s]}"
        )
