"""The decode kernel with several blocks and splits per sequence, in the interpreter off TPU:
ragged lengths (0, inside a block, on a block edge, the whole cache), stale NaN slots, GQA."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close
from pallas_flash_splitkv import DecodeBlocks, split_kv_decode

BLOCKS = [DecodeBlocks(128, 1), DecodeBlocks(128, 3), DecodeBlocks(256, 2), DecodeBlocks()]


@pytest.mark.parametrize("blocks", BLOCKS, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_reference_with_stale_nan_slots(blocks: DecodeBlocks, dtype: str) -> None:
    batch, q_heads, kv_heads, max_len, head_dim = 5, 8, 2, 1000, 64
    lengths = np.array([0, 1, 128, 999, 1000], np.int32)
    q = inputs.normal(0, (batch, q_heads, head_dim), dtype)
    k = np.array(inputs.normal(1, (batch, kv_heads, max_len, head_dim), dtype), np.float32)
    v = np.array(inputs.normal(2, (batch, kv_heads, max_len, head_dim), dtype), np.float32)
    scale = 1 / math.sqrt(head_dim)
    expected = reference.decode(q, k, v, lengths, sm_scale=scale, softcap=2.0)
    for b, length in enumerate(lengths):
        k[b, :, length:] = np.nan
        v[b, :, length:] = np.nan
    out = split_kv_decode(
        q,
        pf.DecodeCache(jnp.asarray(k, q.dtype), jnp.asarray(v, q.dtype)),
        jnp.asarray(lengths),
        spec=pf.DecodeSpec(sm_scale=scale, softcap=2.0),
        blocks=blocks,
        mesh=None,
    )
    assert out.dtype == q.dtype
    assert_close(out, expected, FORWARD_TOLERANCE[dtype])
    assert (np.asarray(out[0], np.float32) == 0).all()


@pytest.mark.parametrize("blocks", [DecodeBlocks(128, 3), DecodeBlocks(256, 2)], ids=str)
def test_traced_lengths_out_of_range_are_clipped(blocks: DecodeBlocks) -> None:
    """Under jit lengths cannot be checked: past ``max_len`` counts as ``max_len`` (a partial
    last block is not read as whole, no index map points past the cache), below 0 as 0."""
    batch, q_heads, kv_heads, max_len, head_dim = 4, 4, 2, 1000, 64
    lengths = np.array([1001, 1100, 2**31 - 1, -3], np.int32)
    q = inputs.normal(0, (batch, q_heads, head_dim))
    k = inputs.normal(1, (batch, kv_heads, max_len, head_dim))
    v = inputs.normal(2, (batch, kv_heads, max_len, head_dim))
    scale = 1 / math.sqrt(head_dim)
    out = jax.jit(
        lambda lengths: split_kv_decode(
            q,
            pf.DecodeCache(k, v),
            lengths,
            spec=pf.DecodeSpec(sm_scale=scale),
            blocks=blocks,
            mesh=None,
        )
    )(lengths)
    clipped = np.clip(lengths, 0, max_len)
    assert_close(
        out, reference.decode(q, k, v, clipped, sm_scale=scale), FORWARD_TOLERANCE["float32"]
    )
    xla = jax.jit(lambda lengths: pf.decode(q, k, v, lengths, backend="xla"))(lengths)
    assert_close(out, xla, FORWARD_TOLERANCE["float32"])
    assert (np.asarray(out[3]) == 0).all()
