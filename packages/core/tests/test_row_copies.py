"""`row_copies.by_powers_of_two`: a dynamic number of rows copied as static-size pieces, every
count from 1 to the most, in Pallas's TPU interpreter; and the pieces compile for v5e."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import row_copies

MOST = 12
"""Not a power of two: the largest piece is 8."""


def _copy_rows(src: jax.Array, first: int, rows: int, interpret: bool) -> jax.Array:
    """``src [32, 128]`` f32's rows ``first`` to ``first + rows - 1`` copied by DMA to the
    same rows of a zero output."""

    def kernel(scalars, src_hbm, out_ref, buffer, sem):
        buffer[...] = jnp.zeros(buffer.shape, buffer.dtype)

        def piece(start, size):
            at = pl.ds(scalars[0] + start, size)
            return pltpu.make_async_copy(src_hbm.at[at], buffer.at[at], sem.at[0])

        row_copies.by_powers_of_two(scalars[1], MOST, piece, lambda c: c.start())
        row_copies.by_powers_of_two(scalars[1], MOST, piece, lambda c: c.wait())
        out_ref[...] = buffer[...]

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(1,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(src.shape, lambda i, s: (0, 0)),
        scratch_shapes=[pltpu.VMEM(src.shape, src.dtype), pltpu.SemaphoreType.DMA((1,))],
    )  # fmt: skip
    call = pl.pallas_call(kernel, grid_spec=spec, out_shape=src,
                          interpret=pltpu.InterpretParams() if interpret else False)  # fmt: skip
    return call(jnp.array([first, rows], jnp.int32), src)


@pytest.mark.parametrize("rows", range(1, MOST + 1))
def test_every_count_copies_exactly_its_rows(rows: int) -> None:
    src = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128) + 1
    first = 5
    out = np.asarray(_copy_rows(src, first, rows, interpret=True))
    expected = np.zeros(src.shape, np.float32)
    expected[first : first + rows] = np.asarray(src)[first : first + rows]
    np.testing.assert_array_equal(out, expected)
