"""Block sizes: validation, clamping to the sequence lengths and the VMEM-fit check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_pallas import BlockSizes, PallasBackend, flash_backward, flash_forward
from pallas_flash_pallas.block_sizes import (
    VMEM_CAPACITY_BYTES,
    backward_vmem_bytes,
    forward_vmem_bytes,
    vmem_limit_bytes,
)

FULL = pf.AttentionSpec(sm_scale=1.0)
CAUSAL = pf.AttentionSpec(sm_scale=1.0, causal=True)
WINDOW = pf.AttentionSpec(sm_scale=1.0, causal=True, window=(512, 0))


def test_defaults_and_clamping() -> None:
    assert BlockSizes().for_call(FULL, 8192, 8192) == BlockSizes(4096, 1024, 256, 1024, 1024, 256)
    assert BlockSizes().for_call(CAUSAL, 8192, 8192) == BlockSizes(2048, 2048, 256, 1024, 1024, 256)
    assert BlockSizes().for_call(WINDOW, 8192, 8192).block_kv == 1024
    assert BlockSizes().for_call(FULL, 130, 7) == BlockSizes(130, 7, 256, 130, 7, 256)
    # Sizes given override the defaults, one by one.
    assert BlockSizes(512, backward_block_kv=512).for_call(FULL, 1000, 4096) == BlockSizes(
        512, 1024, 256, 1000, 512, 256
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_q": 0},
        {"block_kv": -128},
        {"block_q": 1.5},
        {"block_kv": True},
        {"block_q_compute": 64},
        {"backward_block_kv_compute": 200},
        {"backward_block_q": 0},
        {"backward_chunk_blocks": 0},
    ],
)
def test_invalid_sizes_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="BlockSizes"):
        BlockSizes(**kwargs)


def test_a_block_shorter_than_its_sequence_must_be_a_multiple_of_128() -> None:
    assert BlockSizes(block_q=100).for_call(FULL, 100, 512).block_q == 100
    with pytest.raises(ValueError, match="block_q=100 is shorter than the sequence"):
        BlockSizes(block_q=100).for_call(FULL, 101, 512)
    with pytest.raises(ValueError, match="backward_block_kv=200 is shorter than the sequence"):
        BlockSizes(backward_block_kv=200).for_call(FULL, 512, 512)


def test_vmem_estimate_grows_with_blocks() -> None:
    bf16 = np.dtype(jnp.bfloat16)
    small = forward_vmem_bytes(BlockSizes(512, 512, 256), 128, bf16, segment_ids=False)
    large = forward_vmem_bytes(BlockSizes(2048, 2048, 256), 128, bf16, segment_ids=True)
    assert 0 < small < large < VMEM_CAPACITY_BYTES
    assert 32 << 20 <= vmem_limit_bytes(small, "blocks") <= VMEM_CAPACITY_BYTES
    blocks = BlockSizes().for_call(FULL, 4096, 4096)
    backward = backward_vmem_bytes(blocks, 128, bf16, False, group=1, chunk_rows=4096)
    longer = backward_vmem_bytes(blocks, 128, bf16, False, group=4, chunk_rows=4096)
    # The query gradient dominates: a float32 accumulator and two output buffers per head.
    assert longer - backward == 3 * 4096 * 128 * (4 + 2 * 2)
    with pytest.raises(ValueError, match=r"the blocks need about 129\.0 MiB"):
        vmem_limit_bytes(129 << 20, "the blocks")


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
