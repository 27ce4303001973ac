"""A Pallas kernel that writes one row into each of several blocks of a cache, in place: how
`pallas_flash.cache_write.write_rows` writes a contiguous cache's new tokens on TPU.

XLA writes each row with a ``dynamic_update_slice`` of its own, a small op per sequence,
layer and cache array of a decode step (a ``vmap`` of them is a scatter, which re-lays out the
whole cache). This kernel writes all of a layer's rows of one array in one call, the cache in
HBM aliased to the output. A row of 16- or 8-bit values shares its 32-bit words with others
and an HBM copy of them starts on a tile (`row_copies.hbm_copy_rows`), so such a row cannot
be copied on its own: for each row in range the kernel copies the aligned chunk that holds
it into VMEM, patches the row in and copies the chunk back, the copies of all rows in flight
at once. A row of 32-bit values (float32, a packed cache's words) is a chunk of its own,
copied out without a read.

Layouts: ``cache [blocks, kv_heads, length, head_dim]`` (positions on sublanes, chunks of
`chunk_positions` rows) or ``[blocks, kv_heads, length]`` (an int8 cache's scales, positions
on lanes, chunks of 128); ``rows [n, kv_heads, head_dim]`` (scales: ``[n, kv_heads]``);
``blocks``, ``positions`` ``[n]`` int32. Every row in range must have a block of its own: two
rows in one chunk would each write back the other's old value.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import row_copies
from pallas_flash.memory_space import in_hbm

LANES = 128

KERNEL_NAME = "pallas_flash_write_rows"

MAX_CHUNK_BYTES = 8 << 20
"""VMEM the chunks of one call may take (``n`` rows' chunks, all in flight at once)."""


def chunk_positions(cache: jax.Array) -> int:
    """Positions per chunk the kernel copies of ``cache``: the rows an HBM copy starts and ends
    on (`row_copies.hbm_copy_rows`: one row of 32-bit values, a tile of narrower ones; 128
    lanes of scales)."""
    return LANES if cache.ndim == 3 else row_copies.hbm_copy_rows(cache.dtype)


def _chunk_bytes(cache: jax.Array) -> int:
    rest = math.prod(cache.shape[3:])
    return cache.shape[1] * chunk_positions(cache) * rest * cache.dtype.itemsize


def fits(cache: jax.Array, rows: int) -> bool:
    """Whether the kernel can write ``rows`` rows into ``cache``: positions a whole number of
    chunks, and the chunks within `MAX_CHUNK_BYTES`."""
    if cache.ndim not in (3, 4) or cache.shape[2] % chunk_positions(cache):
        return False
    return rows * _chunk_bytes(cache) <= MAX_CHUNK_BYTES


def _kernel(blocks_ref, positions_ref, rows_ref, _, cache_ref, chunks, sems, starts, *, chunk):
    """Refs: ``blocks``, ``positions`` (SMEM); ``rows`` (VMEM); the cache in HBM twice (the
    input, aliased to the output, which is written); scratch: ``chunks [n, kv_heads, chunk,
    ...]``, DMA semaphores ``[2, n]`` and ``starts [n]`` (SMEM: each row's chunk's first
    position, -1 for a row out of range)."""
    n = rows_ref.shape[0]
    num_blocks, length = cache_ref.shape[0], cache_ref.shape[2]

    def copy(i: int, into_vmem: bool):
        span = cache_ref.at[blocks_ref[i], :, pl.ds(pl.multiple_of(starts[i], chunk), chunk)]
        if into_vmem:
            return pltpu.make_async_copy(span, chunks.at[i], sems.at[0, i])
        return pltpu.make_async_copy(chunks.at[i], span, sems.at[1, i])

    def fetch(i: int) -> None:
        if chunk > 1:
            copy(i, True).start()

    def patch(i: int) -> None:
        if chunk == 1:  # the row is the chunk: nothing of it to keep
            chunks[i] = rows_ref[i][:, None]
            copy(i, False).start()
            return
        copy(i, True).wait()
        old = chunks[i]
        here = jax.lax.broadcasted_iota(jnp.int32, old.shape, 1) == positions_ref[i] - starts[i]
        wide = jnp.float32 if jnp.issubdtype(old.dtype, jnp.floating) else jnp.int32
        new = rows_ref[i][:, None].astype(wide)  # [kv_heads, 1, ...]: the chunk's position axis
        chunks[i] = jnp.where(here, new, old.astype(wide)).astype(old.dtype)
        copy(i, False).start()

    def drain(i: int) -> None:
        copy(i, False).wait()

    for i in range(n):
        block, position = blocks_ref[i], positions_ref[i]
        owns = (block >= 0) & (block < num_blocks) & (position >= 0) & (position < length)
        # lax.div: floor division would lower through sign, which needs the chip at trace time
        starts[i] = jnp.where(owns, jax.lax.div(position, chunk) * chunk, -1)
        pl.when(owns)(functools.partial(fetch, i))
    for i in range(n):
        pl.when(starts[i] >= 0)(functools.partial(patch, i))
    for i in range(n):
        pl.when(starts[i] >= 0)(functools.partial(drain, i))


def write_rows_kernel(
    cache: jax.Array,
    rows: jax.Array,
    blocks: jax.Array,
    positions: jax.Array,
    *,
    interpret: pltpu.InterpretParams | bool | None = None,
) -> jax.Array:
    """``cache`` with ``rows[i]`` written at ``[blocks[i], :, positions[i]]`` for every ``i``
    whose block and position are in range, the others writing nothing (layouts in the module
    doc; `fits` must hold). Donate ``cache`` to the enclosing jit for the write to happen in
    place. ``interpret``: the interpreter's settings, or None for Mosaic.

    Its declared cost is what it moves: each row's chunk written, and read first where it
    holds other rows, and the rows.
    """
    n, chunk = rows.shape[0], chunk_positions(cache)
    rows = rows.astype(cache.dtype)
    moved = (2 if chunk > 1 else 1) * n * _chunk_bytes(cache) + rows.size * rows.dtype.itemsize
    return pl.pallas_call(
        functools.partial(_kernel, chunk=chunk),
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[
                pltpu.VMEM((n, cache.shape[1], chunk, *cache.shape[3:]), cache.dtype),
                pltpu.SemaphoreType.DMA((2, n)),
                pltpu.SMEM((n,), jnp.int32),
            ],
        ),
        input_output_aliases={3: 0},
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=moved),
        interpret=False if interpret is None else interpret,
        name=KERNEL_NAME,
    )(blocks.astype(jnp.int32), positions.astype(jnp.int32), rows, in_hbm(cache, interpret))
