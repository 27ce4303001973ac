"""Ragged paged attention on splitkv: a batch's calls of the ragged kernel
(`ragged_kernel`) and how often their loops run.

A batch makes two calls of the kernel (`ragged_blocks.kernel_calls`): the decoding sequences',
whose items each take several of them, a token each, longest first (``DECODE_KERNEL_NAME``,
`ragged_blocks.longest_first`), and the other sequences', with ``block_q`` tokens of one
sequence an item (``KERNEL_NAME``); the second writes its tokens' rows into the first's
output (aliased).

An int8 cache's scales are gathered per sequence before the calls (`_scales_by_sequence`), in
whole kv blocks of both calls. A packed cache's new tokens are written by the calls themselves
(`ragged_attention_and_write`), each its own sequences', from the packed batch they read them
from; other caches come written by core.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import interpret
from pallas_flash.decode_cache import DecodeCache
from pallas_flash.kv_packing import pack_kv
from pallas_flash.ragged_write import token_pages
from pallas_flash.specs import RaggedSpec
from pallas_flash_splitkv import ragged_blocks
from pallas_flash_splitkv.ragged_blocks import (
    DECODE_KERNEL_NAME,
    KERNEL_NAME,
    ItemRange,
    RaggedBlocks,
    item_span,
)
from pallas_flash_splitkv.ragged_call import kernel_call

__all__ = [
    "DECODE_KERNEL_NAME",
    "KERNEL_NAME",
    "loop_runs",
    "ragged_attention",
    "ragged_attention_and_write",
]


def _scales_by_sequence(scales: jax.Array, page_table: jax.Array, columns: int) -> jax.Array:
    """Scales ``[num_pages, kv_heads, page_size]`` per sequence: ``[seqs, kv_heads, columns x
    page_size]`` through the page table (its entries within the pool), padded with page 0
    to ``columns`` pages. A page's scales of one kv head (64 bytes at 16 positions) are too
    short for a DMA (Mosaic wants 512-byte runs), a kv block's of one sequence are not; this
    gather reads ``seqs x pages_per_sequence`` pages' scales, 1/32 of their int8 K or V at
    head_dim 128."""
    _, kv_heads, page_size = scales.shape
    seqs, pages_per_sequence = page_table.shape
    table = jnp.pad(page_table, ((0, 0), (0, columns - pages_per_sequence)))
    by_sequence = scales[table]  # [seqs, columns, kv_heads, page_size]
    return by_sequence.transpose(0, 2, 1, 3).reshape(seqs, kv_heads, columns * page_size)


def _schedule(
    query_starts: jax.Array, kv_lengths: jax.Array, call: ragged_blocks.KernelCall
) -> ragged_blocks.Schedule:
    """The schedule of ``call``: its entries longest first where an item takes several
    (`ragged_blocks.longest_first`)."""
    plan = ragged_blocks.schedule(query_starts, call.entry_tokens, call.items, call.include)
    return plan if call.sequences == 1 else ragged_blocks.longest_first(plan, kv_lengths)


def _ragged_kernel(
    q: jax.Array,
    new: jax.Array | None,
    cache: DecodeCache,
    query_starts: jax.Array,
    kv_lengths: jax.Array,
    sinks: jax.Array | None,
    *,
    spec: RaggedSpec,
    blocks: RaggedBlocks,
    interpret: pltpu.InterpretParams | bool | None,
) -> tuple[jax.Array, jax.Array]:
    """`ragged_attention_and_write` with the interpreter's settings, or None for Mosaic: one
    kernel call per `ragged_blocks.kernel_calls` (the decoding sequences', the others'), each
    writing its own tokens' rows of the one output in place and, for a packed pool, their new
    keys and values (``new``: the packed batch ``[kv_heads, tokens, head_dim]``; None for a
    written cache): the output and the pool's first array."""
    tokens, q_heads, head_dim = q.shape
    num_pages, kv_heads, page_size, _ = cache.k.shape
    pages_per_sequence = cache.page_table.shape[1]
    heads = blocks.heads_for(kv_heads)
    calls = ragged_blocks.kernel_calls(query_starts, q, kv_heads, blocks)
    per_block = {
        c.name: blocks.pages_for(
            page_size, pages_per_sequence, c.name, heads, spec.window, c.sequences
        )
        for c in calls
    }
    # every entry a page of the pool: the kernels read an entry once per page they copy
    table = jnp.clip(cache.page_table, 0, num_pages - 1)
    arrays = [cache.k] if cache.packed else [cache.k, cache.v]
    if cache.quantized:  # scales by sequence in whole kv blocks of every call
        most = math.lcm(*per_block.values())
        columns = -(-pages_per_sequence // most) * most
        arrays += [_scales_by_sequence(x, table, columns)
                   for x in (cache.k_scales, cache.v_scales)]  # fmt: skip
    # an item copies block_q rows: a batch of fewer tokens is padded to one item's rows
    rows = max(tokens, *(call.block_q for call in calls))
    by_group = (rows, kv_heads // heads, heads * (q_heads // kv_heads), head_dim)
    q_rows = jnp.pad(q, ((0, rows - tokens), (0, 0), (0, 0))).reshape(by_group)
    out = jnp.zeros(by_group, q.dtype)  # padding rows stay zeros
    written_pages = []  # where the kernels write the new tokens, each row's page (-1: none)
    if new is not None:
        pages, _ = token_pages(cache.page_table, page_size, query_starts, kv_lengths, tokens)
        written_pages.append(pages)
    for call in calls:
        plan = _schedule(query_starts, kv_lengths, call)
        used = jnp.sum(plan.count > 0, dtype=jnp.int32)[None]  # the entries the items take
        prefetch = [kv_lengths, query_starts, table.reshape(-1), *plan, used, *written_pages]
        out, written = kernel_call(q_rows, out, prefetch, arrays, new, sinks, spec, call,
                                   per_block[call.name], heads, pages_per_sequence,
                                   interpret)  # fmt: skip
        if written is not None:  # the next call reads (and writes) the written pool
            arrays = [written]
    return out.reshape(rows, q_heads, head_dim)[:tokens], arrays[0]


_jitted = interpret.jit_kernel(_ragged_kernel, ("spec", "blocks"), fold_vmap=False)


def ragged_attention(
    q: jax.Array,
    cache: DecodeCache,
    query_starts: jax.Array,
    kv_lengths: jax.Array,
    *,
    spec: RaggedSpec,
    blocks: RaggedBlocks,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """``pf.Backend.ragged_attention`` of validated inputs, the new tokens already written:
    ``[tokens, q_heads, head_dim]`` in q's dtype, zeros for padding rows. Runs as Mosaic or
    interpreted, as `pallas_flash.interpret` decides."""
    out, _ = _jitted(q, None, cache, query_starts, kv_lengths, sinks, spec=spec, blocks=blocks)
    return out


def ragged_attention_and_write(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: DecodeCache,
    query_starts: jax.Array,
    kv_lengths: jax.Array,
    *,
    spec: RaggedSpec,
    blocks: RaggedBlocks,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, DecodeCache]:
    """``pf.Backend.ragged_attention_and_write`` of validated inputs and a packed ``cache``
    (`pallas_flash.kv_packing`): the kernels read each new token's key and value ``k``, ``v``
    ``[tokens, kv_heads, head_dim]`` once, from the batch packed ``[kv_heads, tokens,
    head_dim]`` (one fusion of XLA's, as RPA v3 joins its keys and values), and write it into
    its page from VMEM (`ragged_copies`). The output and the written cache.

    Raises:
      ValueError: ``cache`` is not packed (its rows are not 32-bit: a kernel cannot write one
        alone; core writes such a cache, `pallas_flash.ragged_write`).
    """
    if not cache.packed:
        raise ValueError(
            "cache: expected a packed cache (pallas_flash.pack_kv) for the kernel to write its "
            f"new tokens, got k_cache of dtype {cache.k.dtype} with a v_cache"
        )
    new = jnp.swapaxes(pack_kv(k, v), 0, 1)
    out, pool = _jitted(q, new, cache, query_starts, kv_lengths, sinks, spec=spec, blocks=blocks)
    return out, cache._replace(k=pool)


def loop_runs(
    query_starts: jax.Array,
    kv_lengths: jax.Array,
    *,
    kernel: str,
    tokens: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype,
    page_size: int,
    pages_per_sequence: int,
    spec: RaggedSpec,
    blocks: RaggedBlocks,
) -> tuple[int, ...]:
    """How often the loops of the call named ``kernel`` (`ragged_blocks.KERNEL_NAME` or
    `ragged_blocks.DECODE_KERNEL_NAME`) run on a batch of queries ``[tokens, q_heads,
    head_dim]`` in ``dtype``, in program order: its item loop (every used work item once per
    group of kv heads a grid step takes, `RaggedBlocks.heads_for`), then its loops over kv
    blocks, likewise per group of kv heads (`ItemRange`): the blocks folded whole and the
    masked ones after them; with a window (``spec.window``), at one sequence an item, first
    the masked ones before the whole ones; zeros for a call the batch does not make. An item
    of several sequences (the decode call's) runs its entries' most blocks, whole as long as
    every entry's are. These trip counts are read from memory, so a static schedule needs
    them given (the bench's ``Subject.loop_trips``)."""
    heads = blocks.heads_for(kv_heads)
    head_groups = kv_heads // heads
    queries = jax.ShapeDtypeStruct((tokens, q_heads, head_dim), dtype)
    calls = ragged_blocks.kernel_calls(query_starts, queries, kv_heads, blocks)
    call = next((c for c in calls if c.name == kernel), None)
    sequences = 1 if call is None else call.sequences
    windowed = spec.window is not None and sequences == 1
    if call is None:
        return (0, 0, 0, 0) if windowed else (0, 0, 0)
    block_kv = page_size * blocks.pages_for(page_size, pages_per_sequence, kernel, heads,
                                            spec.window, sequences)  # fmt: skip
    plan = _schedule(query_starts, kv_lengths, call)
    seq = plan.sequence
    r = ItemRange(seq, *item_span(kv_lengths[seq], query_starts[seq + 1], plan.first,
                                  plan.count, spec.window, block_kv,
                                  pages_per_sequence * page_size))  # fmt: skip
    used = np.asarray(plan.count) > 0
    items = -(-int(used.sum()) // sequences)  # the used entries come first

    def by_item(x: jax.Array, unused: int) -> np.ndarray:
        """``[items, sequences]``: each used item's entries' ``x``, ``unused`` for unused
        entries."""
        entries = np.where(used, np.asarray(x), unused)
        whole = np.pad(entries, (0, items * sequences))[: items * sequences]
        return whole.reshape(items, sequences)

    item_blocks = by_item(r.blocks, 0).max(axis=1)
    if sequences == 1:
        head, whole = by_item(r.head, 0)[:, 0], by_item(r.whole, 0)[:, 0]
    else:  # whole for every entry, from the first block
        head = np.zeros_like(item_blocks)
        whole = by_item(np.where(np.asarray(r.head) == 0, r.whole, 0), 2**30).min(axis=1)
    runs = [head_groups * int(x.sum()) for x in (head, whole, item_blocks - head - whole)]
    return (head_groups * items, *runs) if windowed else (head_groups * items, *runs[1:])
