"""One device's view of a paged cache whose pool of pages is split over a mesh.

A pool ``[num_pages, kv_heads, page_size, head_dim]`` split along its pages over ``D``
devices gives device ``d`` the pages ``[d * count, (d + 1) * count)``, ``count = num_pages /
D``. Decoding attends to every position ``< lengths[b]`` whatever its order, so each device
attends to the positions of each sequence that lie in its own pages and the devices' partial
results are merged by their log-sum-exps: the pages never cross the interconnect, and a
sequence whose pages are spread over the devices (`PagedKVCache` allocates page ``j`` of
sequence ``b`` on shard ``(j + b) % D``) is decoded by all of them at once.

`local_pages` turns the global table into the device's own: the pages it holds of each
sequence, moved to the front in table order and indexed within its slice, and the number of
positions they hold. A sequence's last page is the last of its pages on whichever device holds
it, so a device's positions are its full pages plus, when it holds the last page, that page's
rows: a local length the kernel reads exactly as it reads a one-device table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def local_pages(
    page_table: jax.Array, lengths: jax.Array, first: jax.Array, count: int, page_size: int
) -> tuple[jax.Array, jax.Array]:
    """The table and lengths of the pages ``[first, first + count)`` (one device's slice).

    Args:
      page_table: ``[batch, pages_per_sequence]`` int32, global page indices. Entries outside
        every device's slice belong to none: their positions are attended to by no device.
      lengths: ``[batch]`` int32, clipped to ``[0, pages_per_sequence * page_size]``.
      first: the slice's first page (traced: ``axis_index * count``).
      count: pages in the slice.
      page_size: positions per page.

    Returns:
      ``(table, lengths)``: ``[batch, pages_per_sequence]`` int32 indices into the slice, the
      held pages first in table order (the rest 0 and never read), and ``[batch]`` int32, the
      positions those pages hold.
    """
    pages_per_sequence = page_table.shape[1]
    lengths = jnp.clip(lengths, 0, pages_per_sequence * page_size)
    used = -(-lengths // page_size)  # [batch] pages the sequence's positions use
    j = jnp.arange(pages_per_sequence)
    local = page_table - first
    held = (j < used[:, None]) & (local >= 0) & (local < count)
    order = jnp.argsort(~held, axis=1, stable=True)  # held pages first, in table order
    table = jnp.where(
        jnp.take_along_axis(held, order, axis=1), jnp.take_along_axis(local, order, axis=1), 0
    )
    last = jnp.maximum(used - 1, 0)
    holds_last = (used > 0) & jnp.take_along_axis(held, last[:, None], axis=1)[:, 0]
    missing = jnp.where(holds_last, used * page_size - lengths, 0)  # rows past the end
    return table.astype(jnp.int32), (held.sum(axis=1) * page_size - missing).astype(jnp.int32)
