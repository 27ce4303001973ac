"""A Pallas kernel that writes a ragged batch's new tokens into their pages, in place: how
`pallas_flash.cache_write.write_tokens` writes ``pf.ragged_attention``'s keys and values on
TPU.

XLA writes the tokens with one scatter, which XLA on TPU may run on a re-laid-out copy of
the whole pool. This kernel touches only the chunks that hold a new token, the pool in HBM
aliased to the output. A pool's positions are a tiled axis (``[pages, kv_heads, page_size,
head_dim]``: sublanes), so an HBM copy starts and ends on a tile: the kernel works in
*chunks* of `chunk_positions` positions of one page (a whole number of tiles, or the whole
page). A run of a sequence's new tokens that lies in one chunk is one *item*: its tokens are
copied from the batch's own layout into VMEM at their rows of the chunk (every kv head at
once, as copies of static sizes, `row_copies`), the chunk copied into VMEM, the new rows
patched in (kv heads brought first in VMEM) and the chunk copied back; an item that covers
its whole chunk skips the read. Nothing is laid out for the kernel beforehand. No two
sequences write into one page (a page shared through a prefix cache is full, never written),
so no two items share a chunk. The grid takes `items_per_step` items a step, all their
copies in flight at once.

Layouts: ``pool [num_pages, kv_heads, page_size, head_dim]`` (positions on sublanes) or
``[num_pages, kv_heads, page_size]`` (an int8 cache's scales, positions on lanes); ``values
[tokens, kv_heads, head_dim]`` (scales: ``[tokens, kv_heads]``); ``pages``, ``rows``
``[tokens]`` int32: token ``t`` goes to row ``rows[t]`` of page ``pages[t]`` (a page outside
the pool: written nowhere). Scales in pages shorter than a lane tile are left to the scatter
(`fits`). A sequence's tokens must be consecutive rows of the batch at
consecutive positions (`pallas_flash.ragged_batch`), so that the tokens of one page are
consecutive too; a page is in the pool for all of them or for none.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import row_copies

LANES = 128

KERNEL_NAME = "pallas_flash_write_pages"
SCALES_KERNEL_NAME = "pallas_flash_write_page_scales"
"""The kernel's name on a pool of values, and on an int8 cache's scales (their chunks differ)."""

MAX_STEP_BYTES = 8 << 20
"""VMEM one grid step's chunks may take: the items' token rows and the chunks read."""

MAX_ITEMS_PER_STEP = 32
"""Items one grid step takes at most (their copies in flight at once)."""


def chunk_positions(pool: jax.Array | jax.ShapeDtypeStruct) -> int:
    """Positions per chunk of ``pool``: one HBM tile (16 rows of bfloat16, 32 of int8, 8 of
    float32; 128 lanes of scales) when its pages are a whole number of tiles, else the page."""
    page_size = pool.shape[2]
    tile = LANES if len(pool.shape) == 3 else 32 // jnp.dtype(pool.dtype).itemsize
    return tile if page_size % tile == 0 else page_size


def _chunk_bytes(pool: jax.Array | jax.ShapeDtypeStruct) -> int:
    head_dim = pool.shape[3] if len(pool.shape) == 4 else 1
    return pool.shape[1] * chunk_positions(pool) * head_dim * jnp.dtype(pool.dtype).itemsize


def kernel_name(pool: jax.Array | jax.ShapeDtypeStruct) -> str:
    """The kernel's name on ``pool``: `KERNEL_NAME`, or `SCALES_KERNEL_NAME` on scales."""
    return SCALES_KERNEL_NAME if len(pool.shape) == 3 else KERNEL_NAME


def items_per_step(pool: jax.Array, bound: int) -> int:
    """Items one grid step writes: up to `MAX_ITEMS_PER_STEP`, two chunks' worth each (the
    token rows, the chunk read) within `MAX_STEP_BYTES`, at most ``bound`` (the batch's
    `max_items`)."""
    return max(1, min(MAX_ITEMS_PER_STEP, bound, MAX_STEP_BYTES // (2 * _chunk_bytes(pool))))


def fits(pool: jax.Array, tokens: int) -> bool:
    """Whether the kernel can write ``tokens`` tokens into ``pool``: a paged layout (scales:
    pages of whole lane tiles, the offset of a shorter page in HBM being one Mosaic cannot
    prove aligned), and one item's chunks within `MAX_STEP_BYTES`."""
    if pool.ndim not in (3, 4) or tokens == 0 or 2 * _chunk_bytes(pool) > MAX_STEP_BYTES:
        return False
    return pool.ndim == 4 or pool.shape[2] % LANES == 0


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


def max_items(tokens: int, sequences: int | None, chunk: int) -> int:
    """The most items ``tokens`` tokens of ``sequences`` sequences (None: unknown) can make: a
    run of ``n`` consecutive positions lies in at most ``ceil(n / chunk) + 1`` chunks, and no
    more than ``n``, so all of them in fewer than ``tokens / chunk + 2 x sequences``."""
    return tokens if sequences is None else max(1, min(tokens, tokens // chunk + 2 * sequences))


def items(
    pages: jax.Array, rows: jax.Array, num_pages: int, chunk: int, bound: int | None = None
) -> Items:
    """The items of tokens at ``pages``, ``rows`` ``[tokens]`` (module doc), at most ``bound``
    (`max_items`; default ``tokens``): a token starts an item when the token before it is not
    written, or writes another chunk."""
    tokens = pages.shape[0]
    bound = tokens if bound is None else bound
    written = (pages >= 0) & (pages < num_pages)
    start = rows - rows % chunk
    begins = written & (
        ~_previous(written, False) | (_previous(pages, -1) != pages)
        | (_previous(start, -1) != start)
    )  # fmt: skip
    item = jnp.cumsum(begins.astype(jnp.int32)) - 1

    def per_item(x: jax.Array, owners: jax.Array, add: bool = False) -> jax.Array:
        at = jnp.where(owners, item, bound)  # past the end: dropped
        empty = jnp.zeros((bound,), jnp.int32).at[at]
        return empty.add(x, mode="drop") if add else empty.set(x, mode="drop")

    return Items(
        page=per_item(pages, begins),
        start=per_item(start, begins),
        first_row=per_item(rows - start, begins),
        first_token=per_item(jnp.arange(tokens, dtype=jnp.int32), begins),
        tokens=per_item(jnp.ones_like(pages), written, add=True),
        count=jnp.sum(begins, dtype=jnp.int32)[None],
    )


def _previous(x: jax.Array, fill: bool | int) -> jax.Array:
    """``x [tokens]`` shifted one token on, ``fill`` first."""
    return jnp.concatenate([jnp.full((1,), fill, x.dtype), x[:-1]])


def moved_bytes(plan: Items, pool: jax.Array | jax.ShapeDtypeStruct) -> int:
    """HBM bytes the kernel moves on a concrete ``plan``: each item's tokens read (at most a
    chunk's) and its chunk written, and the chunk read first where the item leaves rows of
    it."""
    used = int(plan.count[0])
    partial = int(jnp.sum(plan.tokens[:used] < chunk_positions(pool)))
    return (2 * used + partial) * _chunk_bytes(pool)


def _kernel(
    page_ref, start_ref, first_row_ref, first_token_ref, tokens_ref, count_ref,
    values_ref, _, pool_ref, rows, chunks, sems, *, per_step: int, chunk: int,
):  # fmt: skip
    """One grid step: items ``s x per_step`` to ``s x per_step + per_step - 1``. Refs: the
    items (SMEM); ``values [tokens, kv_heads, ...]`` and the pool twice (the input, aliased to
    the output, which is written), all in HBM; scratch: the items' token rows ``[per_step,
    chunk, kv_heads, ...]`` at their rows of the chunk, ``chunks [per_step, kv_heads, chunk,
    ...]`` and DMA semaphores ``[3, per_step]`` (rows, chunk reads, chunk writes)."""
    first_item = pl.program_id(0) * per_step
    used = jnp.clip(count_ref[0] - first_item, 0, per_step)

    def copy(i: jax.Array, into_vmem: bool):
        item = first_item + i
        span = pool_ref.at[page_ref[item], :, pl.ds(pl.multiple_of(start_ref[item], chunk), chunk)]
        if into_vmem:
            return pltpu.make_async_copy(span, chunks.at[i], sems.at[1, i])
        return pltpu.make_async_copy(chunks.at[i], span, sems.at[2, i])

    def token_rows(i: jax.Array, act) -> None:  # the item's tokens, to their rows of the chunk
        item = first_item + i

        def piece(start: jax.Array, size: int):
            src = values_ref.at[pl.ds(first_token_ref[item] + start, size)]
            dst = rows.at[i, pl.ds(first_row_ref[item] + start, size)]
            return pltpu.make_async_copy(src, dst, sems.at[0, i])

        row_copies.by_powers_of_two(tokens_ref[item], chunk, piece, act)

    def partial_chunk(i: jax.Array) -> jax.Array:  # the item leaves some of its chunk's rows
        return tokens_ref[first_item + i] < chunk

    def fetch(i: jax.Array, carry: None) -> None:
        token_rows(i, lambda c: c.start())
        pl.when(partial_chunk(i))(lambda: copy(i, True).start())
        return carry

    def patch(i: jax.Array, carry: None) -> None:
        token_rows(i, lambda c: c.wait())
        pl.when(partial_chunk(i))(lambda: copy(i, True).wait())
        item = first_item + i
        wide = jnp.float32 if jnp.issubdtype(chunks.dtype, jnp.floating) else jnp.int32
        new = jnp.swapaxes(rows[i].astype(wide), 0, 1)  # [kv_heads, chunk, ...]
        position = jax.lax.broadcasted_iota(jnp.int32, new.shape, 1) - first_row_ref[item]
        here = (position >= 0) & (position < tokens_ref[item])  # rows not copied: unread
        old = chunks[i].astype(wide)  # unread (and unused) when the item covers the chunk
        chunks[i] = jnp.where(here, new, old).astype(chunks.dtype)
        copy(i, False).start()
        return carry

    def drain(i: jax.Array, carry: None) -> None:
        copy(i, False).wait()
        return carry

    for phase in (fetch, patch, drain):
        jax.lax.fori_loop(0, used, phase, None)


def write_tokens_kernel(
    pool: jax.Array,
    values: jax.Array,
    pages: jax.Array,
    rows: jax.Array,
    *,
    sequences: int | None = None,
    interpret: pltpu.InterpretParams | bool | None = None,
) -> jax.Array:
    """``pool`` with ``values[t]`` written at ``[pages[t], :, rows[t]]`` for every token whose
    page is in the pool, the others writing nothing (layouts in the module doc; `fits` must
    hold). Donate ``pool`` to the enclosing jit for the write to happen in place.

    Args:
      sequences: how many sequences the tokens belong to (None: unknown), which bounds the
        items (`max_items`) and so the grid.
      interpret: the interpreter's settings, or None for Mosaic.

    Its declared cost is what it moves at most: each item's chunk read and written, and its
    tokens. Each grid step runs three loops, over its items (`Items.count`): the reads, the
    patches, the writes' waits; the steps past the last item copy nothing.
    """
    tokens, chunk = values.shape[0], chunk_positions(pool)
    bound = max_items(tokens, sequences, chunk)
    per_step = items_per_step(pool, bound)
    plan = items(pages.astype(jnp.int32), rows.astype(jnp.int32), pool.shape[0], chunk, bound)
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)  # never VMEM, however small
    return pl.pallas_call(
        functools.partial(_kernel, per_step=per_step, chunk=chunk),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(plan),
            grid=(-(-bound // per_step),),
            in_specs=[hbm, hbm],
            out_specs=hbm,
            scratch_shapes=[
                pltpu.VMEM((per_step, chunk, *values.shape[1:]), pool.dtype),
                pltpu.VMEM((per_step, pool.shape[1], chunk, *pool.shape[3:]), pool.dtype),
                pltpu.SemaphoreType.DMA((3, per_step)),
            ],
        ),
        input_output_aliases={len(plan) + 1: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), disable_bounds_checks=True
        ),
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=3 * bound * _chunk_bytes(pool)
        ),
        interpret=False if interpret is None else interpret,
        name=kernel_name(pool),
    )(*plan, values.astype(pool.dtype), pool)
