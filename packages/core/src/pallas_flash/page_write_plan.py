"""What the page write (`pallas_flash.page_write_kernel`) copies for a ragged batch's new
tokens: the pages the batch writes whole, and the chunks it writes the other tokens into.

A pool's positions are a tiled axis of its HBM layout, so a copy into a page starts and ends
on a *chunk* (a whole number of tiles, or the whole page). The batch's tokens make two kinds
of work:
- *whole pages* (`WholePages`): a page every position of which a run of the batch's tokens
  writes (a prompt chunk's middle pages) is one item: its tokens copied in, the page copied
  out, nothing read.
- *chunk items* (`Items`): every other run of a sequence's tokens that lies in one chunk (a
  decode token, a prompt chunk's first and last pages): its chunk read where it keeps rows,
  patched and written back.

``pages``, ``rows`` ``[tokens]`` int32: token ``t`` goes to row ``rows[t]`` of page
``pages[t]``; a page outside ``[0, num_pages)`` is written nowhere. A sequence's tokens are
consecutive rows of the batch at consecutive positions (`pallas_flash.ragged_batch`) and no
two sequences write one page, so a page's tokens are one run of consecutive tokens.
Everything here is found by compares and scans over the tokens, no scatter or gather: XLA
on TPU runs those element by element.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_flash.ragged_batch import count_at_most, lookup


class Items(NamedTuple):
    """The chunks a batch writes, ``[max_items]`` int32 each (item ``i`` for ``i < count[0]``;
    the rest unused).

    Attributes:
      page: the item's page.
      start: its chunk's first position in the page.
      first_row: its first new row within the chunk.
      first_token: its first token in the batch.
      tokens: its number of tokens (consecutive rows of the chunk).
      count: ``[1]``: how many items are used.
    """

    page: jax.Array
    start: jax.Array
    first_row: jax.Array
    first_token: jax.Array
    tokens: jax.Array
    count: jax.Array


class WholePages(NamedTuple):
    """The pages a batch writes whole, ``[max_whole_pages]`` int32 each (page item ``i`` for
    ``i < count[0]``; the rest unused).

    Attributes:
      page: the page.
      first_token: the token written at its row 0 (its ``page_size`` tokens follow).
      count: ``[1]``: how many are used.
    """

    page: jax.Array
    first_token: jax.Array
    count: jax.Array


def max_items(tokens: int, sequences: int | None, chunk: int) -> int:
    """The most items ``tokens`` tokens of ``sequences`` sequences (None: unknown) can make: a
    run of ``n`` consecutive positions lies in at most ``ceil(n / chunk) + 1`` chunks, and no
    more than ``n``, so all of them in fewer than ``tokens / chunk + 2 x sequences``."""
    return tokens if sequences is None else max(1, min(tokens, tokens // chunk + 2 * sequences))


def max_whole_pages(tokens: int, page_size: int) -> int:
    """The most pages ``tokens`` tokens can write whole."""
    return tokens // page_size


def whole(pages: jax.Array, rows: jax.Array, num_pages: int, page_size: int) -> jax.Array:
    """``[tokens]`` bool: each token whose page the batch writes whole. A page is written
    whole where its row 0 and its last row are written by tokens ``page_size - 1`` apart (a
    page's tokens are consecutive, so all its rows are between); its tokens are those that
    follow such a start by less than ``page_size`` (starts are at least a page apart).
    Static shifts and one running sum: XLA on TPU runs a running max far slower."""
    written = (pages >= 0) & (pages < num_pages)
    span = page_size - 1
    starts = (
        written & (rows == 0)
        & (_shifted(pages, -span, -1) == pages) & (_shifted(rows, -span, -1) == span)
    )  # fmt: skip
    begun = jnp.cumsum(starts, dtype=jnp.int32)
    return begun - _shifted(begun, page_size, 0) > 0


def whole_pages(
    pages: jax.Array, rows: jax.Array, num_pages: int, page_size: int, whole_tokens: jax.Array
) -> WholePages:
    """The pages written whole (``whole_tokens``: `whole`), at most `max_whole_pages`."""
    bound = max(1, max_whole_pages(pages.shape[0], page_size))
    begins = whole_tokens & (rows == 0)
    begun = jnp.cumsum(begins, dtype=jnp.int32)
    item = jnp.arange(bound, dtype=jnp.int32)
    used = item < begun[-1]
    first = jnp.minimum(count_at_most(begun, item), pages.shape[0] - 1)
    return WholePages(
        page=jnp.where(used, lookup(pages, first), 0),
        first_token=jnp.where(used, first, 0),
        count=begun[-1:],
    )


def items(
    pages: jax.Array, rows: jax.Array, num_pages: int, chunk: int, bound: int | None = None
) -> Items:
    """The chunk items of tokens at ``pages``, ``rows`` ``[tokens]`` (module doc), at most
    ``bound`` (`max_items`; default ``tokens``): a token starts an item when the token before
    it is not written, or writes another chunk. Tokens of pages written whole are left out by
    giving them a page outside the pool. Found by comparing every item with every token
    (`ragged_batch.lookup`)."""
    tokens = pages.shape[0]
    bound = tokens if bound is None else bound
    written = (pages >= 0) & (pages < num_pages)
    start = rows - rows % chunk
    begins = written & (
        ~_shifted(written, 1, False) | (_shifted(pages, 1, -1) != pages)
        | (_shifted(start, 1, -1) != start)
    )  # fmt: skip
    begun = jnp.cumsum(begins, dtype=jnp.int32)  # [tokens]: items begun up to each token
    item = jnp.arange(bound, dtype=jnp.int32)
    used = item < begun[-1]
    first = jnp.minimum(count_at_most(begun, item), tokens - 1)  # the token beginning item i
    # an item's tokens: the written ones from its first on, up to the next item's first
    mine = written[None, :] & (begun[None, :] == item[:, None] + 1)
    count = jnp.sum(mine, axis=1, dtype=jnp.int32)

    def per_item(x: jax.Array) -> jax.Array:
        return jnp.where(used, lookup(x, first), 0)

    return Items(
        page=per_item(pages),
        start=per_item(start),
        first_row=per_item(rows - start),
        first_token=jnp.where(used, first, 0),
        tokens=jnp.where(used, count, 0),
        count=begun[-1:],
    )


def _shifted(x: jax.Array, by: int, fill: bool | int) -> jax.Array:
    """``x [tokens]`` moved ``by`` tokens on (``by > 0``: each token sees the one ``by``
    before it; ``by < 0``: the one ``-by`` after), ``fill`` where there is none."""
    n = x.shape[0]
    if abs(by) >= n:
        return jnp.full((n,), fill, x.dtype)
    pad = jnp.full((abs(by),), fill, x.dtype)
    return jnp.concatenate([pad, x[: n - by]]) if by > 0 else jnp.concatenate([x[-by:], pad])
