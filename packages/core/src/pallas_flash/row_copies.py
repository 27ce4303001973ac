"""Copies of a dynamic number of rows by manual DMA, as a few copies of static sizes.

A Mosaic DMA of a dynamic number of rows is staged through a VMEM copy loop of a dynamic trip
count: scalar and vector work on every copy, and a loop whose runs the static estimate cannot
count. `by_powers_of_two` makes one copy of a static size for each power of two in the
number of rows, the larger first (at most ``log2(most) + 1`` copies); a DMA semaphore counts
bytes, so the same pieces are waited for the same way. `hbm_copy_rows`: where a copy of rows
of an HBM array may start and end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def by_powers_of_two(
    rows: jax.Array, most: int, copy: Callable[[jax.Array, int], Any], act: Callable[[Any], None]
) -> None:
    """``act`` on ``copy(start, size)`` for each power of two ``size`` in ``rows`` (1 to
    ``most``): the copy of rows ``start`` to ``start + size - 1``, ``start`` the rows the
    larger sizes took (inside a Pallas TPU kernel)."""
    size = 1 << (most.bit_length() - 1)
    while size >= 1:
        start = rows & -2 * size

        @pl.when((rows & size) != 0)
        def _piece(size: int = size, start: jax.Array = start) -> None:
            act(copy(start, size))

        size //= 2


def hbm_copy_rows(dtype: jnp.dtype) -> int:
    """The rows a copy along the rows of a kernel's ``[..., rows, 128]`` operand of ``dtype``
    in HBM starts and ends on. XLA lays 32-bit values out in tiles of 8 rows (``T(8,128)``),
    each row a sublane of 32-bit words, which a DMA addresses alone: any row (Mosaic compiles a
    copy of one row at a dynamic offset, v5e). 16- and 8-bit values share 32-bit words between
    2 and 4 rows (``T(8,128)(2,1)``, ``T(32,128)(4,1)``): a copy starts and ends on a tile, of
    8 and 32 rows (Mosaic: "Offsets along tiled dimensions must be aligned to tiles")."""
    return {4: 1, 2: 8, 1: 32}[jnp.dtype(dtype).itemsize]
