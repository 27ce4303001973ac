"""int8 cache blocks to bfloat16 for the MXU, two rows per 32-bit word in one step.

Mosaic converts an int8 block to bfloat16 by unpacking each byte to int32, converting it to
float32 and packing pairs of float32 registers to bfloat16 with a relayout that costs more
vector ops than the packing itself. An int8 value is exact in bfloat16, so its float32 bits
are its bfloat16 bits followed by 16 zero bits: one shift and one OR put two float32
registers into one 32-bit word per element, which `pltpu.bitcast` reads as two bfloat16 rows
(rows ``2r`` and ``2r + 1`` from word row ``r``). Pairing row ``r`` with row ``r + 8`` of each
16-row group (whole float32 registers, no shuffle) gives the block with its rows in
`paired_order`. On v5e (jax 0.10.2, static schedule) this cut a paged int8 decode step of
512 positions x 8 kv heads from 2,445 to 2,197 bundles, and a contiguous one of 1,024
positions from 1,666 to 1,410.

Softmax and ``p @ v`` do not care about the order of positions, as long as the scores, the
scales and the positions used for masking follow the same one: `pair_lanes` puts a
``[rows, positions]`` array of scales in that order (lane rotations and selects; no MXU work,
whose weight pushes already bound an int8 step if a push costs 16 cycles).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

GROUP = 16
"""Rows that trade places: row ``r < 8`` and row ``r + 8`` of a group become rows ``2r`` and
``2r + 1``."""

_LANES = 128


def paired_order(positions: int) -> jax.Array:
    """``[1, positions]`` int32: the original position of each row of `to_bfloat16_paired`'s
    output (``16 (j // 16) + 8 (j % 2) + (j % 16) // 2`` for row ``j``)."""
    j = lax.broadcasted_iota(jnp.int32, (1, positions), 1)
    # bit operations, not % and //: Mosaic lowers a signed % through `sign`, which asks the
    # default device for the TPU's generation (an AOT compile on a CPU host has none)
    return (j & -GROUP) | ((j & 1) << 3) | ((j & (GROUP - 1)) >> 1)


def to_bfloat16_paired(x: jax.Array) -> jax.Array:
    """int8 ``[heads, positions, head_dim]`` (positions a multiple of 16) to bfloat16, the
    rows in `paired_order`; exact."""
    heads, positions, head_dim = x.shape
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    bits = bits.reshape(heads, positions // GROUP, 2, GROUP // 2, head_dim)
    words = lax.shift_right_logical(bits[:, :, 0], 16) | bits[:, :, 1]  # low half: row r
    return pltpu.bitcast(words.reshape(heads, positions // 2, head_dim), jnp.bfloat16)


def pair_lanes(values: jax.Array) -> jax.Array:
    """``[rows, positions]`` (positions a multiple of 128) in `paired_order` along the last
    axis: in each group of 16 lanes, a perfect shuffle of its two halves (lane ``r`` to
    ``2r``, lane ``8 + r`` to ``2r + 1``) in three butterfly stages, each swapping the middle
    two of four blocks of 4, 2 and 1 lanes (two lane rotations and two selects a stage, on
    each 128-lane block; exact)."""
    lane = lax.broadcasted_iota(jnp.int32, (1, _LANES), 1)
    blocks = []
    for i in range(0, values.shape[-1], _LANES):
        block = values[:, i : i + _LANES]
        for shift in (2, 1, 0):
            size = 1 << shift
            quarter = (lane >> shift) & 3  # lane // size % 4
            from_right = pltpu.roll(block, _LANES - size, 1)  # [j] = block[j + size]
            from_left = pltpu.roll(block, size, 1)  # [j] = block[j - size]
            block = jnp.where(quarter == 1, from_right, jnp.where(quarter == 2, from_left, block))
        blocks.append(block)
    return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=-1)
