"""Small helpers the forward and backward kernels share."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash_pallas.blocks.block_sizes import LANES
from pallas_flash_pallas.blocks.schedule import KvSchedule

NT = (((1,), (1,)), ((), ()))
"""``lax.dot_general`` dimension numbers of ``a b^T`` (contract the last dims: ``q k^T``)."""
NN = (((1,), (0,)), ((), ()))
"""``a b`` (``p v``)."""
TN = (((0,), (0,)), ((), ()))
"""``a^T b``."""

IndexMap = Callable[..., tuple]


def query_grid_maps(schedule: KvSchedule, group: int) -> tuple[IndexMap, IndexMap, IndexMap]:
    """Index maps of a grid ``(b, h, i, j)`` that keeps query block ``i`` of head ``h``
    resident while kv step ``j`` streams `KvSchedule.kv_block` past (the forward and the dq
    kernel): ``(q-shaped block [b, h, i, 0], kv block [b, h // group, kv_block, 0], row of
    lanes [b, h, 0, i])``; GQA: query head ``h`` reads kv head ``h // group``."""

    def q_map(b, h, i, j):
        return b, h, i, 0

    def kv_map(b, h, i, j):
        return b, lax.div(h, jnp.int32(group)), schedule.kv_block(i, j), 0

    def row_map(b, h, i, j):
        return b, h, 0, i

    return q_map, kv_map, row_map


def broadcast_block(shape: tuple[int, ...], b: jax.Array, h: jax.Array) -> tuple:
    """Block indices of the batch and head axes of a bias ``[batch or 1, heads or 1, ...]``
    for grid batch ``b`` and head ``h``: 0 on an axis of size 1 (broadcast, never copied)."""
    return (b if shape[0] > 1 else 0), (h if shape[1] > 1 else 0)


def lanes(x: jax.Array, width: int) -> jax.Array:
    """``[rows, 128]`` with equal lanes to ``[rows, width]``."""
    if width % LANES == 0:
        return jnp.tile(x, (1, width // LANES))
    if width < LANES:
        return x[:, :width]
    return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def zero_rows_from(x: jax.Array, first: jax.Array, end: int) -> jax.Array:
    """``x [rows, cols]`` with rows at positions ``>= end`` zeroed, row 0 at ``first``."""
    pos = first + lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.where(pos < end, x, jnp.zeros_like(x))


def both(a: jax.Array | None, b: jax.Array) -> jax.Array:
    """``a & b``, where a None ``a`` (no mask) means all True."""
    return b if a is None else a & b


def recomputed_probabilities(
    logits: jax.Array, lse: jax.Array, visible: jax.Array | None, bias: bool
) -> jax.Array:
    """The backward's ``p = exp(logits - lse)`` (a tile, either orientation), 0 where a pair is
    hidden: by ``visible`` (which also drops ``exp(-inf + inf)`` of rows that see no key) and,
    with a ``bias``, where the logit is ``-inf`` (a row the bias hides wholly has lse -inf)."""
    p = jnp.exp(logits - lse)
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    if bias:
        p = jnp.where(logits == -jnp.inf, 0.0, p)
    return p


def when(condition: bool | jax.Array, body: Callable[[], None]) -> None:
    """Runs ``body`` if ``condition`` is True, under ``pl.when`` if it is traced."""
    if condition is True:
        body()
    else:
        pl.when(condition)(body)


def mask_diagonal_tile(
    x: jax.Array, first_col: int, *, keys_on_rows: bool, fill: float
) -> jax.Array:
    """``x [m, n]`` with its square causal tile masked: the columns ``first_col ..
    first_col + m - 1`` (fewer if ``n`` ends first), where tile row ``r`` and column ``c``
    stay if ``c <= r`` (columns are keys) or ``r <= c`` (``keys_on_rows``), else become
    ``fill``. The other columns are left as they are: only the tile pays for the mask.

    ``first_col`` must be a multiple of 128 (whole vregs).
    """
    width = min(x.shape[0], x.shape[1] - first_col)
    tile = x[:, first_col : first_col + width]
    rows = lax.broadcasted_iota(jnp.int32, tile.shape, 0)
    cols = lax.broadcasted_iota(jnp.int32, tile.shape, 1)
    keep = rows <= cols if keys_on_rows else cols <= rows
    tile = jnp.where(keep, tile, jnp.asarray(fill, x.dtype))
    parts = [x[:, :first_col], tile, x[:, first_col + width :]]
    return jnp.concatenate([p for p in parts if p.shape[1]], axis=1)
