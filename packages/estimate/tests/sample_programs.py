"""Programs the estimate tests compile: module-level, so the estimate's worker imports them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _matmul_kernel(x_ref, y_ref, z_ref) -> None:
    z_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32).astype(
        z_ref.dtype
    )


def blocked_matmul(x: jax.Array, y: jax.Array, *, bm: int, bn: int) -> jax.Array:
    """``x @ y``: x ``[m, k]``, y ``[k, n]``, one Pallas grid step per ``[bm, bn]`` output
    block (the whole of ``k`` at once)."""
    (m, k), n = x.shape, y.shape[1]
    return pl.pallas_call(
        _matmul_kernel,
        grid=(m // bm, n // bn),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
    )(x, y)


def plain_matmul(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x @ y``, XLA's."""
    return x @ y


def doubled(x: jax.Array) -> jax.Array:
    """``2 x``: one elementwise pass over HBM (memory-bound)."""
    return x * 2


def _sparse_kernel(table_ref, x_ref, z_ref) -> None:
    z_ref[...] = x_ref[...]

    @pl.when(table_ref[pl.program_id(0)] != 0)
    def _() -> None:
        x = y = x_ref[...]
        for _ in range(8):  # MXU-bound where it runs
            y = jnp.dot(y, x, preferred_element_type=jnp.float32).astype(x.dtype)
        z_ref[...] = y


def _sparse_call(x: jax.Array, steps: jax.Array, table: jax.Array) -> jax.Array:
    """``x [steps * b, b]``'s blocks, to the 9th power where ``table`` is not 0, else copied:
    a grid of ``steps`` (a traced count: sized at run time) and a table read from SMEM. It
    declares the flops of raising every block of ``x``."""
    b = x.shape[1]
    return pl.pallas_call(
        _sparse_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(steps,),
            in_specs=[pl.BlockSpec((b, b), lambda i, t: (i, 0))],
            out_specs=pl.BlockSpec((b, b), lambda i, t: (i, 0)),
        ),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        name="sparse_blocks",
        cost_estimate=pl.CostEstimate(
            flops=8 * 2 * x.shape[0] * b * b, transcendentals=0, bytes_accessed=2 * x.nbytes
        ),
    )(table, x)


def sparse_blocks(x: jax.Array, *, every: int) -> jax.Array:
    """`_sparse_call` on every block of ``x`` (a grid of ``x.shape[0] // x.shape[1]`` steps),
    raising every ``every``-th: the count and the table are computed in the program, and
    the table a NumPy array, as a block-sparse mask's tables are (splash's ``MaskInfo``); XLA
    folds the count into a constant."""
    steps = x.shape[0] // x.shape[1]
    count = jnp.sum(jnp.ones(steps, jnp.int32))
    table = (np.arange(steps, dtype=np.int32) % every == 0).astype(np.int32)
    return _sparse_call(x, count, jnp.asarray(table))


def sparse_blocks_given(x: jax.Array, steps: jax.Array) -> jax.Array:
    """`_sparse_call` on the first ``steps`` blocks of ``x``, a count the program is given at
    run time, raising all of them."""
    table = jnp.ones(x.shape[0] // x.shape[1], jnp.int32)
    return _sparse_call(x, steps.astype(jnp.int32), table)
