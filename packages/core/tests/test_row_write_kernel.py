"""`pallas_flash.row_write_kernel` in the TPU interpreter (DMAs simulated, races detected):
the same cache as one ``dynamic_update_slice`` per row, for bfloat16, int8 and 32-bit values
(a row a chunk, written without a read) and float32 scales, with rows out of range that write
nothing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import cache_write, row_write_kernel
from pallas_flash.interpret import recorded_races

BLOCKS = jnp.asarray([0, 1, 2, 3, 4, 5, 6, -1, 9], jnp.int32)  # -1 and 9: no such block
POSITIONS = jnp.asarray([0, 5, 17, 255, 128, 256, 3, 1, 2], jnp.int32)  # 256: past the end


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((8, 2, 256, 128), "bfloat16"),
        ((8, 2, 256, 128), "int8"),
        ((8, 2, 256, 128), "uint32"),
        ((8, 2, 256), "float32"),
    ],
    ids=["bfloat16", "int8", "32-bit", "scales"],
)
def test_writes_what_one_update_per_row_writes(shape: tuple[int, ...], dtype: str) -> None:
    cache = (jnp.arange(np.prod(shape)) % 7 + 1).reshape(shape).astype(dtype)
    rows_shape = (len(BLOCKS), *shape[1:2], *shape[3:])
    rows = (jnp.arange(np.prod(rows_shape)) % 97 + 10).reshape(rows_shape).astype(dtype)
    assert row_write_kernel.fits(cache, len(BLOCKS))
    interpret = pltpu.InterpretParams(detect_races=True)
    with recorded_races() as races:
        got = row_write_kernel.write_rows_kernel(
            cache, rows, BLOCKS, POSITIONS, interpret=interpret
        )
    assert [state.races_found for state in races] == [False]
    expected = cache_write._write_rows(cache, rows, BLOCKS, POSITIONS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert not np.array_equal(np.asarray(got), np.asarray(cache))


def test_fits_whole_chunks_within_the_vmem_budget() -> None:
    assert row_write_kernel.chunk_positions(jnp.zeros((1, 1, 32, 128), jnp.bfloat16)) == 8
    assert row_write_kernel.chunk_positions(jnp.zeros((1, 1, 32, 128), jnp.int8)) == 32
    assert row_write_kernel.chunk_positions(jnp.zeros((1, 1, 32, 128), jnp.uint32)) == 1
    assert row_write_kernel.chunk_positions(jnp.zeros((1, 1, 128), jnp.float32)) == 128
    assert not row_write_kernel.fits(jnp.zeros((1, 1, 36, 128), jnp.bfloat16), 1)
    assert not row_write_kernel.fits(jnp.zeros((1, 1, 100), jnp.float32), 1)
    big = jnp.zeros((1, 64, 32, 128), jnp.bfloat16)  # 128 KiB of chunk a row
    assert row_write_kernel.fits(big, 64) and not row_write_kernel.fits(big, 65)
