"""A Pallas kernel that writes a ragged batch's new tokens into their pages, in place: how
`pallas_flash.cache_write.write_tokens` writes ``pf.ragged_attention``'s keys and values on
TPU.

XLA writes the tokens with one scatter, which XLA on TPU may run on a re-laid-out copy of the
whole pool. This kernel touches only the chunks that hold a new token, the pool in HBM aliased
to the output. A pool's positions are a tiled axis (``[pages, kv_heads, page_size, head_dim]``:
sublanes), so an HBM copy of 16- or 8-bit values starts and ends on a tile: the kernel works in
*chunks* of `chunk_positions` positions of one page (a whole number of tiles, or the whole
page; one position of a 32-bit pool, a row a copy writes alone: a packed cache's,
`pallas_flash.kv_packing`). A run of a sequence's new tokens that lies in one chunk is one
*item*: its tokens are copied from the batch's own layout into VMEM at their rows of the chunk
(every kv head at once, as copies of static sizes, `row_copies`), the chunk copied into VMEM,
the new rows patched in (kv heads brought first in VMEM) and the chunk copied back; an item
that covers its whole chunk skips the read. Nothing is laid out for the kernel beforehand but
one kv head's values, all pools' stacked in one array (`_as_read`). No two sequences write into
one page (a page shared through a prefix cache is full, never written), so no two items share a
chunk. One call writes the pools of one cache together (keys and values, or their scales), one
item at a time for all of them, in groups of `items_per_group` items whose copies are all in
flight at once.

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
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import page_write_plan, row_copies
from pallas_flash.memory_space import in_hbm

LANES = 128

KERNEL_NAME = "pallas_flash_write_pages"
SCALES_KERNEL_NAME = "pallas_flash_write_page_scales"
"""The kernel's name on a pool of values, and on an int8 cache's scales (their chunks differ)."""

MAX_GROUP_BYTES = 8 << 20
"""VMEM one group of items may take: their token rows and the chunks read, every pool's."""

MAX_ITEMS_PER_GROUP = 32
"""Items whose copies are in flight at once, at most."""

MAX_KERNEL_BYTES = 12 << 20
"""VMEM the kernel's groups take together, at most: a group of chunk items and one of pages
written whole, within v5e's default scoped VMEM (16 MiB)."""


def chunk_positions(pool: jax.Array | jax.ShapeDtypeStruct) -> int:
    """Positions per chunk of ``pool``: the rows an HBM copy starts and ends on
    (`row_copies.hbm_copy_rows`: one row of 32-bit values, as a packed pool's, a tile of
    narrower ones; 128 lanes of scales) when its pages are a whole number of them, else the
    page."""
    page_size = pool.shape[2]
    tile = LANES if len(pool.shape) == 3 else row_copies.hbm_copy_rows(pool.dtype)
    return tile if page_size % tile == 0 else page_size


def _chunk_bytes(pool: jax.Array | jax.ShapeDtypeStruct) -> int:
    head_dim = pool.shape[3] if len(pool.shape) == 4 else 1
    return pool.shape[1] * chunk_positions(pool) * head_dim * jnp.dtype(pool.dtype).itemsize


def kernel_name(pool: jax.Array | jax.ShapeDtypeStruct) -> str:
    """The kernel's name on ``pool``: `KERNEL_NAME`, or `SCALES_KERNEL_NAME` on scales."""
    return SCALES_KERNEL_NAME if len(pool.shape) == 3 else KERNEL_NAME


def items_per_group(pool: jax.Array, bound: int, pools: int = 1) -> int:
    """Items whose copies the kernel keeps in flight at once: up to `MAX_ITEMS_PER_GROUP`, two
    chunks' worth each per pool of ``pools`` like ``pool`` (the token rows, the chunk read)
    within `MAX_GROUP_BYTES`, at most ``bound`` (the batch's `max_items`)."""
    per_item = 2 * pools * _chunk_bytes(pool)
    return max(1, min(MAX_ITEMS_PER_GROUP, bound, MAX_GROUP_BYTES // per_item))


def fits(pool: jax.Array, tokens: int) -> bool:
    """Whether the kernel can write ``tokens`` tokens into ``pool``: a paged layout (scales:
    pages of whole lane tiles, the offset of a shorter page in HBM being one Mosaic cannot
    prove aligned), and one item's chunks, for keys and values, within `MAX_GROUP_BYTES`."""
    if pool.ndim not in (3, 4) or tokens == 0 or 4 * _chunk_bytes(pool) > MAX_GROUP_BYTES:
        return False
    return pool.ndim == 4 or pool.shape[2] % LANES == 0


def whole_pages_per_group(
    pool: jax.Array | jax.ShapeDtypeStruct,
    tokens: int,
    sequences: int | None = None,
    pools: int = 1,
) -> int:
    """Pages written whole whose copies the kernel keeps in flight at once: up to
    `MAX_ITEMS_PER_GROUP`, two pages' worth each per pool of ``pools`` like ``pool`` (the
    tokens, the page) within `MAX_GROUP_BYTES` and what the group of chunk items of
    ``tokens`` tokens of ``sequences`` sequences (`items_per_group`) leaves of
    `MAX_KERNEL_BYTES`, at most the pages ``tokens`` tokens can fill; 0 where the kernel
    writes no page whole: pages of one chunk (a chunk item copies them whole already), of
    scales, of rows that are not whole VMEM tiles (``32 / itemsize``) or too large for a
    group."""
    if len(pool.shape) != 4:
        return 0
    page_size, chunk = pool.shape[2], chunk_positions(pool)
    per_page = 2 * pools * _chunk_bytes(pool) * (page_size // chunk)
    items = items_per_group(pool, page_write_plan.max_items(tokens, sequences, chunk), pools)
    budget = min(MAX_GROUP_BYTES, MAX_KERNEL_BYTES - items * 2 * pools * _chunk_bytes(pool))
    vmem_tile = 32 // jnp.dtype(pool.dtype).itemsize
    if page_size == chunk or page_size % vmem_tile or per_page > budget:
        return 0
    bound = page_write_plan.max_whole_pages(tokens, page_size)
    return max(0, min(MAX_ITEMS_PER_GROUP, bound, budget // per_page))


def plan(
    pool: jax.Array | jax.ShapeDtypeStruct,
    pages: jax.Array,
    rows: jax.Array,
    sequences: int | None = None,
    pools: int = 1,
) -> tuple[page_write_plan.Items, page_write_plan.WholePages]:
    """The kernel's work on tokens at ``pages``, ``rows`` ``[tokens]`` of ``sequences``
    sequences (None: unknown) written into ``pools`` pools like ``pool``: the pages it
    writes whole (none where `whole_pages_per_group` is 0) and the chunk items of the other
    tokens."""
    num_pages, page_size = pool.shape[0], pool.shape[2]
    pages, rows = pages.astype(jnp.int32), rows.astype(jnp.int32)
    tokens, chunk = pages.shape[0], chunk_positions(pool)
    whole_tokens = page_write_plan.whole(pages, rows, num_pages, page_size)
    if whole_pages_per_group(pool, tokens, sequences, pools) == 0:
        whole_tokens = jnp.zeros_like(whole_tokens)
    wholes = page_write_plan.whole_pages(pages, rows, num_pages, page_size, whole_tokens)
    bound = page_write_plan.max_items(tokens, sequences, chunk)
    chunk_items = page_write_plan.items(
        jnp.where(whole_tokens, -1, pages), rows, num_pages, chunk, bound
    )
    return chunk_items, wholes


def group_sizes(
    pool: jax.Array | jax.ShapeDtypeStruct, tokens: int, sequences: int | None, pools: int
) -> tuple[int, int]:
    """The kernel's groups on ``tokens`` tokens of ``sequences`` sequences written into
    ``pools`` pools like ``pool``: chunk items per group (`items_per_group`) and pages
    written whole per group (`whole_pages_per_group`; 0: none)."""
    bound = page_write_plan.max_items(tokens, sequences, chunk_positions(pool))
    return (
        items_per_group(pool, bound, pools),
        whole_pages_per_group(pool, tokens, sequences, pools),
    )


def loop_runs(
    pool: jax.Array | jax.ShapeDtypeStruct,
    pages: jax.Array,
    rows: jax.Array,
    sequences: int | None = None,
    pools: int = 1,
) -> tuple[int, ...]:
    """How often the kernel's loops run on a concrete batch (``pages``, ``rows`` as `plan`
    takes them), in program order: its groups of chunk items, then its reads, patches and
    writes' waits, each once per item; the same four for the pages it writes whole, where it
    writes any (`write_tokens_kernel`)."""
    per_group, pages_per_group = group_sizes(pool, pages.shape[0], sequences, pools)
    chunk_items, wholes = (int(x.count[0]) for x in plan(pool, pages, rows, sequences, pools))
    runs = (-(-chunk_items // per_group), chunk_items, chunk_items, chunk_items)
    if pages_per_group == 0:
        return runs
    return (*runs, -(-wholes // pages_per_group), wholes, wholes, wholes)


def moved_bytes(
    work: tuple[page_write_plan.Items, page_write_plan.WholePages],
    pool: jax.Array | jax.ShapeDtypeStruct,
) -> int:
    """HBM bytes the kernel moves on a concrete plan (`plan`): each chunk item's tokens read
    (at most a chunk's) and its chunk written, and the chunk read first where the item
    leaves rows of it; each page written whole, its tokens read and the page written."""
    chunk_items, wholes = work
    used = int(chunk_items.count[0])
    partial = int(jnp.sum(chunk_items.tokens[:used] < chunk_positions(pool)))
    page_bytes = _chunk_bytes(pool) * pool.shape[2] // chunk_positions(pool)
    return (2 * used + partial) * _chunk_bytes(pool) + 2 * int(wholes.count[0]) * page_bytes


def _kernel(
    page_ref, start_ref, first_row_ref, first_token_ref, tokens_ref, count_ref,
    whole_page_ref, whole_first_ref, whole_count_ref, *refs,
    pools: int, stacked: bool, per_group: int, pages_per_group: int, chunk: int,
):  # fmt: skip
    """The one grid step: the used chunk items in groups of ``per_group``, then the pages
    written whole in groups of ``pages_per_group``, each group's copies all in flight at
    once. Refs: the chunk items, then the whole pages (SMEM); the values (``stacked``: one
    ``[tokens, pools x kv_heads, ...]`` for all ``pools`` pools, `_as_read`; else one
    ``[tokens, kv_heads, ...]`` per pool), then each pool twice (the inputs, aliased to the
    outputs, which are written), all in HBM; scratch: per values array the items' token rows
    ``[per_group, chunk, heads, ...]`` at their rows of the chunk, then per pool ``chunks
    [per_group, kv_heads, chunk, ...]``, DMA semaphores ``[3, per_group]`` (rows, chunk reads,
    chunk writes; a pool's copies of one item share them, a semaphore counting bytes); where
    pages are written whole, per values array their tokens ``[pages_per_group, page_size,
    heads, head_dim]``, per pool the pages ``[pages_per_group, kv_heads, page_size,
    head_dim]``, and DMA semaphores ``[2, pages_per_group]`` (tokens, page writes)."""
    arrays = 1 if stacked else pools
    values_refs, pool_refs = refs[:arrays], refs[arrays + pools : arrays + 2 * pools]
    scratch = refs[arrays + 2 * pools :]
    row_bufs, chunk_bufs = scratch[:arrays], scratch[arrays : arrays + pools]
    sems, whole_refs = scratch[arrays + pools], scratch[arrays + pools + 1 :]
    if pages_per_group:
        page_rows, page_bufs = whole_refs[:arrays], whole_refs[arrays : arrays + pools]
        page_sems = whole_refs[arrays + pools]

    def new_rows(bufs, i: jax.Array) -> list[jax.Array]:
        """Each pool's new rows of item ``i`` of the token buffers ``bufs``, kv heads first."""
        if not stacked:
            return [_heads_first(buf[i]) for buf in bufs]
        heads = _heads_first(bufs[0][i])  # [pools x kv_heads, rows, ...]
        kv_heads = heads.shape[0] // pools
        return [heads[j * kv_heads : (j + 1) * kv_heads] for j in range(pools)]

    def group(g: jax.Array, carry: None) -> None:
        first_item = g * per_group

        def copies(i: jax.Array, into_vmem: bool) -> list:
            item = first_item + i
            at = pl.ds(pl.multiple_of(start_ref[item], chunk), chunk)
            spans = [pool.at[page_ref[item], :, at] for pool in pool_refs]
            if into_vmem:
                return [pltpu.make_async_copy(span, buf.at[i], sems.at[1, i])
                        for span, buf in zip(spans, chunk_bufs, strict=True)]  # fmt: skip
            return [pltpu.make_async_copy(buf.at[i], span, sems.at[2, i])
                    for span, buf in zip(spans, chunk_bufs, strict=True)]  # fmt: skip

        def token_rows(i: jax.Array, act) -> None:  # the item's tokens, to their chunk rows
            item = first_item + i

            def pieces(start: jax.Array, size: int) -> list:
                rows_at = pl.ds(first_row_ref[item] + start, size)
                tokens_at = pl.ds(first_token_ref[item] + start, size)
                return [pltpu.make_async_copy(values.at[tokens_at], buf.at[i, rows_at],
                                              sems.at[0, i])
                        for values, buf in zip(values_refs, row_bufs, strict=True)]  # fmt: skip

            row_copies.by_powers_of_two(tokens_ref[item], chunk, pieces, lambda cs: _each(act, cs))

        def partial_chunk(i: jax.Array) -> jax.Array:  # the item leaves some of its chunk's rows
            return tokens_ref[first_item + i] < chunk

        def fetch(i: jax.Array, carry: None) -> None:
            token_rows(i, _start)
            pl.when(partial_chunk(i))(lambda: _each(_start, copies(i, True)))
            return carry

        def patch(i: jax.Array, carry: None) -> None:
            token_rows(i, _wait)
            pl.when(partial_chunk(i))(lambda: _each(_wait, copies(i, True)))
            item = first_item + i
            for new, chunks in zip(new_rows(row_bufs, i), chunk_bufs, strict=True):
                position = jax.lax.broadcasted_iota(jnp.int32, new.shape, 1) - first_row_ref[item]
                here = (position >= 0) & (position < tokens_ref[item])  # rows not copied: unread
                old = chunks[i].astype(new.dtype)  # unread, unused, where the item covers the chunk
                chunks[i] = jnp.where(here, new, old).astype(chunks.dtype)
            _each(_start, copies(i, False))
            return carry

        used = jnp.minimum(count_ref[0] - first_item, per_group)
        _in_phases(used, fetch, patch, lambda i: copies(i, False))
        return carry

    def page_group(g: jax.Array, carry: None) -> None:
        first_page = g * pages_per_group

        def copies(i: jax.Array, into_vmem: bool) -> list:
            item = first_page + i
            if into_vmem:
                at = pl.ds(whole_first_ref[item], page_rows[0].shape[1])
                return [pltpu.make_async_copy(values.at[at], buf.at[i], page_sems.at[0, i])
                        for values, buf in zip(values_refs, page_rows, strict=True)]  # fmt: skip
            return [pltpu.make_async_copy(buf.at[i], pool.at[whole_page_ref[item]],
                                          page_sems.at[1, i])
                    for pool, buf in zip(pool_refs, page_bufs, strict=True)]  # fmt: skip

        def fetch(i: jax.Array, carry: None) -> None:
            _each(_start, copies(i, True))
            return carry

        def patch(i: jax.Array, carry: None) -> None:
            _each(_wait, copies(i, True))
            for new, page in zip(new_rows(page_rows, i), page_bufs, strict=True):
                page[i] = new.astype(page.dtype)
            _each(_start, copies(i, False))
            return carry

        used = jnp.minimum(whole_count_ref[0] - first_page, pages_per_group)
        _in_phases(used, fetch, patch, lambda i: copies(i, False))
        return carry

    # lax.div, not //: Mosaic lowers a signed // through `sign`, which asks the default device
    # for the TPU's generation (an AOT compile on a CPU host has none)
    groups = jax.lax.div(count_ref[0] + per_group - 1, jnp.int32(per_group))
    jax.lax.fori_loop(0, groups, group, None)
    if pages_per_group:
        groups = jax.lax.div(whole_count_ref[0] + pages_per_group - 1, jnp.int32(pages_per_group))
        jax.lax.fori_loop(0, groups, page_group, None)


def _in_phases(
    used: jax.Array,
    fetch: Callable[[jax.Array, None], None],
    patch: Callable[[jax.Array, None], None],
    writes: Callable[[jax.Array], list],
) -> None:
    """A group's three loops over its ``used`` items, each item's copies in flight across
    the group: ``fetch`` starts its reads, ``patch`` waits for them, patches and starts its
    ``writes``, which the last loop waits for."""

    def drain(i: jax.Array, carry: None) -> None:
        _each(_wait, writes(i))
        return carry

    for phase in (fetch, patch, drain):
        jax.lax.fori_loop(0, used, phase, None)


def _heads_first(rows: jax.Array) -> jax.Array:
    """Token rows ``[positions, kv_heads, ...]`` as a page holds them, ``[kv_heads, positions,
    ...]``, widened to 32 bits (where Mosaic relays them out)."""
    wide = jnp.float32 if jnp.issubdtype(rows.dtype, jnp.floating) else jnp.int32
    return jnp.swapaxes(rows.astype(wide), 0, 1)


def _as_read(values: Sequence[jax.Array], dtype: jnp.dtype) -> tuple[list[jax.Array], bool]:
    """``values`` (one ``[tokens, kv_heads, ...]`` per pool) as the kernel reads them, in the
    pools' ``dtype``, and whether stacked: of one kv head, in one array ``[tokens, pools,
    head_dim]``. XLA lays a ``[tokens, 1, head_dim]`` array out with tokens on sublanes
    (``{2,0,1}``), where a DMA of one token's row cannot start, and would relay each pool's
    out for Mosaic, half-empty tiles of a token each (``T(2,128)``). Set side by side on lanes
    (XLA's own layout) and then reshaped, they are one dense relayout instead (static v5e,
    1,270 tokens: 2.4k cycles, against 9.8k for each of the two)."""
    values = [v.astype(dtype) for v in values]
    if len(values) > 1 and values[0].ndim == 3 and values[0].shape[1] == 1:
        tokens, _, head_dim = values[0].shape
        side_by_side = jnp.concatenate(values, axis=2)  # [tokens, 1, pools x head_dim]
        return [side_by_side.reshape(tokens, len(values), head_dim)], True
    return values, False


def _start(copy) -> None:
    copy.start()


def _wait(copy) -> None:
    copy.wait()


def _each(act: Callable[[Any], None], copies: list) -> None:
    for copy in copies:
        act(copy)


def write_tokens_kernel(
    pools: Sequence[jax.Array],
    values: Sequence[jax.Array],
    pages: jax.Array,
    rows: jax.Array,
    *,
    sequences: int | None = None,
    interpret: pltpu.InterpretParams | bool | None = None,
) -> tuple[jax.Array, ...]:
    """Each of ``pools`` with its ``values[t]`` written at ``[pages[t], :, rows[t]]`` for
    every token whose page is in the pool, the others writing nothing (layouts in the module
    doc; `fits` must hold): the pools of one cache (keys and values, or their scales) at once,
    one plan and one item loop for all. Donate the pools to the enclosing jit for the writes
    to happen in place.

    Args:
      pools: pools of one shape and dtype.
      values: ``[tokens, kv_heads, ...]`` each, one per pool.
      sequences: how many sequences the tokens belong to (None: unknown), which bounds the
        items (`page_write_plan.max_items`).
      interpret: the interpreter's settings, or None for Mosaic.

    Its declared cost is what it moves at most: each chunk item's chunks read and written, and
    its tokens (a page written whole moves fewer bytes than its chunks as items would). It
    runs one grid step: a loop over groups of chunk items (`items_per_group`), and in each
    group three loops over its items (`page_write_plan.Items.count`): the reads, the patches,
    the writes' waits; then the same loops over the pages written whole
    (`whole_pages_per_group`, `page_write_plan.WholePages.count`).
    """
    pool = pools[0]
    if len(values) != len(pools) or any(
        (p.shape, p.dtype) != (pool.shape, pool.dtype) for p in pools
    ):
        raise ValueError(
            "write_tokens_kernel: expected pools of one shape and dtype and one values array "
            f"each, got pools {[(p.shape, str(p.dtype)) for p in pools]} and "
            f"{len(values)} values"
        )
    values, stacked = _as_read(values, pool.dtype)
    tokens, chunk = values[0].shape[0], chunk_positions(pool)
    n = len(pools)
    per_group, pages_per_group = group_sizes(pool, tokens, sequences, n)
    chunk_items, wholes = plan(pool, pages, rows, sequences, n)
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)  # Mosaic's side; XLA's: `in_hbm` below
    token_rows = pltpu.VMEM((per_group, chunk, *values[0].shape[1:]), pool.dtype)
    chunks = pltpu.VMEM((per_group, pool.shape[1], chunk, *pool.shape[3:]), pool.dtype)
    whole_scratch = []
    if pages_per_group:
        page_tokens = (pages_per_group, pool.shape[2], *values[0].shape[1:])
        whole_scratch = [
            *[pltpu.VMEM(page_tokens, pool.dtype)] * len(values),
            *[pltpu.VMEM((pages_per_group, *pool.shape[1:]), pool.dtype)] * n,
            pltpu.SemaphoreType.DMA((2, pages_per_group)),
        ]
    prefetch = (*chunk_items, *wholes)
    written = pl.pallas_call(
        functools.partial(
            _kernel,
            pools=n,
            stacked=stacked,
            per_group=per_group,
            pages_per_group=pages_per_group,
            chunk=chunk,
        ),
        out_shape=[jax.ShapeDtypeStruct(pool.shape, pool.dtype)] * n,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(1,),
            in_specs=[hbm] * (len(values) + n),
            out_specs=[hbm] * n,
            scratch_shapes=[
                *[token_rows] * len(values),
                *[chunks] * n,
                pltpu.SemaphoreType.DMA((3, per_group)),
                *whole_scratch,
            ],
        ),
        input_output_aliases={len(prefetch) + len(values) + i: i for i in range(n)},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), disable_bounds_checks=True
        ),
        cost_estimate=pl.CostEstimate(
            flops=0,
            transcendentals=0,
            bytes_accessed=3 * n * chunk_items.page.shape[0] * _chunk_bytes(pool),
        ),
        interpret=False if interpret is None else interpret,
        name=kernel_name(pool),
    )(*prefetch, *values, *(in_hbm(pool, interpret) for pool in pools))
    return tuple(written)
