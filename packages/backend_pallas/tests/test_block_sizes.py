"""Block sizes: validation, defaults per TPU generation, balancing and clamping to the
sequence lengths, and the VMEM-fit check."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import tpu
from pallas_flash_pallas import BlockSizes, PallasBackend, flash_backward, flash_forward
from pallas_flash_pallas.blocks.block_sizes import (
    backward_vmem_bytes,
    balanced,
    default_block_sizes,
    forward_vmem_bytes,
    full_block_tiles,
    vmem_limit_bytes,
)

V5E = tpu.GENERATIONS["v5e"]

FULL = pf.AttentionSpec(sm_scale=1.0)
CAUSAL = pf.AttentionSpec(sm_scale=1.0, causal=True)
WINDOW = pf.AttentionSpec(sm_scale=1.0, causal=True, window=(512, 0))


def test_defaults_and_clamping() -> None:
    full = BlockSizes().for_call(FULL, 16384, 16384, V5E)
    assert full == BlockSizes(8192, 1024, 1024, 1024, 1024, 256, full_block_compute=2048)
    # float32: query blocks of one 2048-row tile; bfloat16 as 16-bit (the default)
    f32 = BlockSizes().for_call(FULL, 16384, 16384, V5E, dtype=np.dtype("float32"))
    assert f32 == BlockSizes(2048, 1024, 1024, 1024, 1024, 256, full_block_compute=2048)
    assert BlockSizes().for_call(FULL, 16384, 16384, V5E, dtype=jnp.bfloat16) == full
    causal = BlockSizes().for_call(CAUSAL, 8192, 8192, V5E)
    assert causal == BlockSizes(2048, 2048, 256, 1024, 1024, 256, full_block_compute=1024)
    f32_causal = BlockSizes().for_call(CAUSAL, 8192, 8192, V5E, dtype=np.dtype("float32"))
    assert f32_causal == causal  # 2048 rows already
    assert BlockSizes().for_call(WINDOW, 8192, 8192, V5E).block_kv == 1024
    assert BlockSizes().for_call(FULL, 130, 7, V5E) == BlockSizes(
        130, 7, 1024, 130, 7, 256, full_block_compute=2048
    )
    # Sizes given override the defaults, one by one, and are not balanced.
    assert BlockSizes(512, backward_block_kv=512).for_call(FULL, 1000, 4096, V5E) == BlockSizes(
        512, 1024, 1024, 1000, 512, 256, full_block_compute=2048
    )
    assert BlockSizes(4096).for_call(FULL, 6144, 6144, V5E).block_q == 4096


def test_short_key_sequences_are_one_kv_block() -> None:
    """Without a mask on v5e, calls of up to 2048 queries and keys take all keys in one kv
    block (one grid step); longer ones, masked calls and generations with less VMEM are
    balanced."""
    assert BlockSizes().for_call(FULL, 1536, 1536, V5E).block_kv == 1536
    assert BlockSizes().for_call(FULL, 1024, 2048, V5E).block_kv == 2048
    assert BlockSizes().for_call(FULL, 4096, 2048, V5E).block_kv == 1024
    assert BlockSizes().for_call(FULL, 3072, 3072, V5E).block_kv == 1024
    assert BlockSizes().for_call(WINDOW, 2048, 2048, V5E).block_kv == 1024
    assert BlockSizes().for_call(FULL, 2048, 2048, tpu.GENERATIONS["v5p"]).block_kv == 1024
    assert BlockSizes(block_kv=512).for_call(FULL, 1536, 1536, V5E).block_kv == 512


@pytest.mark.parametrize(
    ("block", "length", "expected"),
    [
        (4096, 6144, 3072),  # two blocks, not 4096 + a half-empty 2048
        (4096, 5120, 2560),
        (2048, 5120, 1280),  # four whole blocks, not three of 1792 (5 % padding)
        (1024, 1536, 768),
        (4096, 100_000, 3712),  # 27 blocks (100,224 rows), not 25 (102,400)
        (2048, 100_000, 2048),  # 49 blocks (100,352 rows): padding under 1 %
        (1024, 100_000, 1024),
        (256, 300, 128),  # no count pads under 1 %: the least padding
        (2048, 12288, 2048),
        (4096, 4096, 4096),
        (4096, 1000, 1000),  # one block: the whole sequence
    ],
)
def test_balanced_blocks(block: int, length: int, expected: int) -> None:
    got = balanced(block, length)
    assert got == expected
    assert got == min(block, length) or (got % 128 == 0 and block <= 2 * got <= 2 * block), (
        "a multiple of 128 at most the block and at least half of it"
    )


def test_default_blocks_are_balanced_over_the_sequence() -> None:
    assert BlockSizes().for_call(FULL, 12288, 12288, V5E) == BlockSizes(
        6144, 1024, 1024, 1024, 1024, 256, full_block_compute=2048
    )
    assert BlockSizes().for_call(CAUSAL, 5120, 5120, V5E) == BlockSizes(
        1280, 1280, 256, 1024, 1024, 256, full_block_compute=1024
    )
    assert BlockSizes().for_call(CAUSAL, 1536, 1536, V5E) == BlockSizes(
        1536, 1536, 256, 768, 768, 256, full_block_compute=1024
    )


@pytest.mark.parametrize(
    ("block_q", "block_kv", "tile", "expected"),
    [
        # One key range, several row tiles: the last cut 3:1.
        (6144, 1024, 2048, [(0, 2048, 0, 1024), (2048, 2048, 0, 1024), (4096, 1536, 0, 1024),
                            (5632, 512, 0, 1024)]),
        (3072, 1024, 2048, [(0, 2048, 0, 1024), (2048, 768, 0, 1024), (2816, 256, 0, 1024)]),
        # At most one tile of rows: tiles of half as many, not cut.
        (1024, 1024, 2048, [(0, 1024, 0, 1024)]),
        (1536, 768, 2048, [(0, 1024, 0, 768), (1024, 512, 0, 768)]),
        # Two key ranges (causal 2048 x 2048): not cut.
        (2048, 2048, 1024, [(0, 1024, 0, 1024), (1024, 1024, 0, 1024), (0, 1024, 1024, 1024),
                            (1024, 1024, 1024, 1024)]),
        # Partial last key range; a last tile too short to cut (128 rows).
        (256, 300, 128, [(0, 128, 0, 128), (128, 128, 0, 128), (0, 128, 128, 128),
                         (128, 128, 128, 128), (0, 128, 256, 44), (128, 128, 256, 44)]),
    ],
)  # fmt: skip
def test_full_block_tiles(block_q: int, block_kv: int, tile: int, expected: list) -> None:
    tiles = full_block_tiles(block_q, block_kv, tile)
    assert tiles == expected
    covered = np.zeros((block_q, block_kv), int)
    for first_row, rows, first_key, keys in tiles:
        covered[first_row : first_row + rows, first_key : first_key + keys] += 1
    assert (covered == 1).all(), "the tiles cover the block once"


@pytest.mark.parametrize("generation", list(tpu.GENERATIONS.values()), ids=list(tpu.GENERATIONS))
@pytest.mark.parametrize("spec", [FULL, CAUSAL, WINDOW], ids=["full", "causal", "window"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("segment_ids", [False, True])
@pytest.mark.parametrize("length", [2048, 32768])
def test_default_blocks_fit_every_generation(
    generation: tpu.TpuGeneration, spec, head_dim: int, dtype, segment_ids: bool, length: int
) -> None:
    """The defaults of each generation fit its VMEM at every supported head_dim and dtype,
    with and without segment ids, for long and short sequences (one kv block): a default call
    never raises the VMEM error."""
    blocks = BlockSizes().for_call(spec, length, length, generation)
    dtype = np.dtype(dtype)
    needs = [
        forward_vmem_bytes(blocks, head_dim, dtype, segment_ids),
        backward_vmem_bytes(
            blocks, head_dim, dtype, segment_ids, group=1, chunk_rows=blocks.backward_block_q
        ),
    ]
    for needed in needs:
        assert vmem_limit_bytes(needed, "defaults", generation) <= generation.vmem_bytes


def test_generations_with_less_vmem_get_shorter_blocks() -> None:
    v4, v5p = tpu.GENERATIONS["v4"], tpu.GENERATIONS["v5p"]
    assert BlockSizes().for_call(FULL, 16384, 16384, tpu.GENERATIONS["v6e"]) == BlockSizes(
        8192, 1024, 1024, 1024, 1024, 256, full_block_compute=2048
    )
    assert BlockSizes().for_call(FULL, 8192, 8192, v5p).block_q < 4096
    small = BlockSizes().for_call(CAUSAL, 8192, 8192, v4)
    assert max(small.block_q, small.block_kv, small.backward_block_q) < 2048


def test_wide_mxus_take_unmasked_tiles_of_at_least_1024_rows() -> None:
    """v7x (64 MiB like v5p, 256-wide MXUs like v6e): its unmasked and causal tiles are half
    its 2048-row blocks, where v5p's 128-wide MXUs keep a quarter; a window keeps its 512."""
    v5p, v7x = tpu.GENERATIONS["v5p"], tpu.GENERATIONS["v7x"]
    assert (v5p.mxu_width, v7x.mxu_width, tpu.GENERATIONS["v6e"].mxu_width) == (128, 256, 256)
    assert v7x.vmem_bytes == v5p.vmem_bytes
    for spec in (FULL, CAUSAL):
        assert default_block_sizes(spec, v5p).full_block_compute == 512
        assert default_block_sizes(spec, v7x).full_block_compute == 1024
    window = dataclasses.replace(CAUSAL, window=(1024, 0))
    assert default_block_sizes(window, v7x).full_block_compute == 512


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_q": 0},
        {"block_kv": -128},
        {"block_q": 1.5},
        {"block_kv": True},
        {"block_q_compute": 64},
        {"backward_block_kv_compute": 200},
        {"full_block_compute": 100},
        {"backward_block_q": 0},
        {"backward_chunk_blocks": 0},
    ],
)
def test_invalid_sizes_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="BlockSizes"):
        BlockSizes(**kwargs)


def test_a_block_shorter_than_its_sequence_must_be_a_multiple_of_128() -> None:
    assert BlockSizes(block_q=100).for_call(FULL, 100, 512, V5E).block_q == 100
    with pytest.raises(ValueError, match="block_q=100 is shorter than the sequence"):
        BlockSizes(block_q=100).for_call(FULL, 101, 512, V5E)
    with pytest.raises(ValueError, match="backward_block_kv=200 is shorter than the sequence"):
        BlockSizes(backward_block_kv=200).for_call(FULL, 512, 512, V5E)


def test_vmem_estimate_grows_with_blocks() -> None:
    bf16 = np.dtype(jnp.bfloat16)
    small = forward_vmem_bytes(BlockSizes(512, 512, 256), 128, bf16, segment_ids=False)
    large = forward_vmem_bytes(BlockSizes(2048, 2048, 256), 128, bf16, segment_ids=True)
    assert 0 < small < large < V5E.vmem_bytes
    assert 32 << 20 <= vmem_limit_bytes(small, "blocks", V5E) <= V5E.vmem_bytes
    v4 = tpu.GENERATIONS["v4"]
    assert vmem_limit_bytes(small, "blocks", v4) <= v4.vmem_bytes
    blocks = BlockSizes().for_call(FULL, 4096, 4096, V5E)
    backward = backward_vmem_bytes(blocks, 128, bf16, False, group=1, chunk_rows=4096)
    longer = backward_vmem_bytes(blocks, 128, bf16, False, group=4, chunk_rows=4096)
    # The query gradient dominates: a float32 accumulator and two output buffers per head.
    assert longer - backward == 3 * 4096 * 128 * (4 + 2 * 2)
    with pytest.raises(ValueError, match=r"the blocks need about 129\.0 MiB .* TPU v5e core"):
        vmem_limit_bytes(129 << 20, "the blocks", V5E)


def test_oversized_blocks_raise_before_compiling() -> None:
    """The check runs at trace time: abstract inputs suffice, nothing is compiled or run."""
    x = jax.ShapeDtypeStruct((1, 1, 16384, 256), jnp.float32)
    spec = pf.AttentionSpec(sm_scale=0.0625)
    huge = BlockSizes(16384, 16384, 16384)
    with pytest.raises(
        ValueError, match=r"forward block sizes .* MiB of VMEM, .* smaller BlockSizes"
    ):
        jax.eval_shape(lambda q, k, v: flash_forward(q, k, v, spec=spec, block_sizes=huge), x, x, x)


def test_oversized_backward_blocks_raise_before_compiling() -> None:
    x = jax.ShapeDtypeStruct((1, 1, 16384, 256), jnp.float32)
    rows = jax.ShapeDtypeStruct((1, 1, 1, 16384), jnp.float32)
    spec = pf.AttentionSpec(sm_scale=0.0625)
    huge = BlockSizes(backward_block_q=16384, backward_block_kv=16384)

    def backward(q, k, v, out, lse, d_out):
        return flash_backward(q, k, v, None, out, lse, d_out, spec=spec, block_sizes=huge)

    with pytest.raises(ValueError, match=r"backward block sizes .* MiB of VMEM"):
        jax.eval_shape(backward, x, x, x, x, rows, x)


def test_backend_passes_its_block_sizes() -> None:
    x = jax.ShapeDtypeStruct((1, 1, 16384, 256), jnp.float32)
    spec = pf.AttentionSpec(sm_scale=0.0625)
    backend = PallasBackend(BlockSizes(16384, 16384, 16384), name="pallas-huge")
    assert backend.name == "pallas-huge"
    with pytest.raises(ValueError, match="VMEM"):
        jax.eval_shape(lambda q, k, v: backend.attention(q, k, v, spec), x, x, x)
