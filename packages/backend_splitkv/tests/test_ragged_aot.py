"""Ahead-of-time compilation of ``pf.ragged_attention`` on the ``splitkv`` backend for one TPU
v5e chip by the real compiler (libtpu; no TPU needed, skipped without it): a serving step of
256 new tokens from 16 sequences against a pool of 2,048 pages, with the cache donated. Mosaic
compiles the kernels within VMEM (core's write of the new tokens, or for a packed pool the
attention's own, and the attention); the pool is written in place and never copied."""

from __future__ import annotations

import importlib.util
import math

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
from pallas_flash import page_write_kernel
from pallas_flash_estimate.read import hlo_ops
from pallas_flash_splitkv.ragged_attention import DECODE_KERNEL_NAME, KERNEL_NAME

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason="libtpu (the TPU compiler) is not installed",
    ),
    pytest.mark.usefixtures("mosaic"),
]

TOKENS, SEQS, PAGES_PER_SEQUENCE, Q_HEADS = 256, 16, 128, 8


@pytest.mark.parametrize(
    ("kv_heads", "head_dim", "page_size", "cache", "window"),
    [
        (2, 128, 16, "bfloat16", None),
        (1, 128, 64, "packed", 256),
        (2, 64, 32, "packed", None),
        (2, 128, 16, "int8", 100),
        (2, 128, 128, "int8", None),
    ],
    ids=[
        "bf16-kv2-page16",
        "packed-kv1-page64-window",
        "packed-d64-page32",
        "int8-page16-window",
        "int8-page128",
    ],
)
def test_a_serving_step_compiles_with_the_pool_in_place(
    v5e_devices: list[jax.Device], kv_heads: int, head_dim: int, page_size: int, cache: str,
    window: int | None,
) -> None:  # fmt: skip
    """``cache``: bfloat16 K and V pools, one packed pool of both (uint32), or int8 pools
    with their scales."""
    device = jax.sharding.SingleDeviceSharding(v5e_devices[0])

    def struct(shape, dtype, kept: bool = False):  # kept: the pool, in `pf.cache_format`
        placed = pf.cache_format(device, len(shape)) if kept else device
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    num_pages = SEQS * PAGES_PER_SEQUENCE
    pool = (num_pages, kv_heads, page_size, head_dim)
    new = struct((TOKENS, kv_heads, head_dim), jnp.bfloat16)
    packed, quantized = cache == "packed", cache == "int8"
    dtype = jnp.uint32 if packed else jnp.dtype(cache)
    pools = [struct(pool, dtype, True)] * (1 if packed else 2)
    if quantized:
        pools += [struct(pool[:3], jnp.float32, True)] * 2
    layout = [struct((SEQS, PAGES_PER_SEQUENCE), jnp.int32), struct((SEQS + 1,), jnp.int32),
              struct((SEQS,), jnp.int32)]  # fmt: skip
    args = [struct((TOKENS, Q_HEADS, head_dim), jnp.bfloat16), new, new, *pools, *layout]

    arrays = len(pools)

    def step(q, k, v, *pools_and_layout):
        held, layout = pools_and_layout[:arrays], pools_and_layout[arrays:]
        k_cache, v_cache = (held[0], None) if packed else held[:2]
        extra = {"k_scales": held[2], "v_scales": held[3]} if quantized else {}
        out, cache = pf.ragged_attention(
            q, k, v, k_cache, v_cache, *layout, backend="splitkv",
            softcap=30.0, sliding_window=window, sinks=jnp.zeros((Q_HEADS,)), **extra,
        )  # fmt: skip
        return out, cache._replace(page_table=None)

    donated = tuple(range(3, 3 + arrays))
    kept, kept_scales = pf.cache_format(device, 4), pf.cache_format(device, 3)
    scales_out = kept_scales if quantized else None
    out_cache = pf.DecodeCache(kept, None if packed else kept, None, scales_out, scales_out)
    jitted = jax.jit(step, donate_argnums=donated, out_shardings=(None, out_cache))
    compiled = jitted.trace(*args).lower(lowering_platforms=("tpu",)).compile()
    text = compiled.as_text()
    calls = [op.name.split(".")[0] for op in hlo_ops.kernel_calls(text)]
    # core writes K and V by one call of its kernel (their int8 scales, in pages of whole
    # lane tiles, by another); the ragged calls write a packed pool's new tokens themselves
    writes = [] if packed else [page_write_kernel.KERNEL_NAME]
    if quantized and page_size % 128 == 0:
        writes += [page_write_kernel.SCALES_KERNEL_NAME]
    assert sorted(calls) == sorted([KERNEL_NAME, DECODE_KERNEL_NAME, *writes])
    cache_bytes = math.prod(pool) * 2 * jnp.dtype(jnp.bfloat16 if packed else dtype).itemsize
    # both kernels' sides copy only q-sized data (the new tokens laid out per chunk, q and
    # output per work item, int8 scales gathered per sequence), never the pool
    q_bytes = TOKENS * Q_HEADS * head_dim * 2
    copies = [(op.name, op.bytes, op.relayout) for op in hlo_ops.find_copy_trap(text)]
    assert [c for c in copies if c[1] > 4 * q_bytes and c[2] is not False] == [], copies
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= cache_bytes
    assert memory.temp_size_in_bytes < cache_bytes // 4  # q-sized: no copy of a pool


def _compiled_bf16_step(
    device: jax.Device, tokens: int, seqs: int, heads: tuple[int, int], pages: int
) -> str:
    """The optimized HLO of one bfloat16 ragged step of ``tokens`` new tokens from ``seqs``
    sequences at ``heads`` (query, kv) of 128, ``pages`` pages of 128 a sequence, compiled for
    ``device`` with the pool donated."""
    (q_heads, kv_heads), head_dim, page_size = heads, 128, 128
    device = jax.sharding.SingleDeviceSharding(device)

    def struct(shape, dtype, kept: bool = False):
        placed = pf.cache_format(device, len(shape)) if kept else device
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    pool = struct((seqs * pages, kv_heads, page_size, head_dim), jnp.bfloat16, True)
    new = struct((tokens, kv_heads, head_dim), jnp.bfloat16)
    args = [struct((tokens, q_heads, head_dim), jnp.bfloat16), new, new, pool, pool,
            struct((seqs, pages), jnp.int32), struct((seqs + 1,), jnp.int32),
            struct((seqs,), jnp.int32)]  # fmt: skip

    def step(q, k, v, k_cache, v_cache, table, starts, lengths):
        out, cache = pf.ragged_attention(
            q, k, v, k_cache, v_cache, table, starts, lengths, backend="splitkv"
        )
        return out, cache._replace(page_table=None)

    kept = pf.cache_format(device, 4)
    out_cache = pf.DecodeCache(kept, kept, None, None, None)
    jitted = jax.jit(step, donate_argnums=(3, 4), out_shardings=(None, out_cache))
    return jitted.trace(*args).lower(lowering_platforms=("tpu",)).compile().as_text()


def test_a_batch_shorter_than_an_automatic_item_copies_no_queries(
    v5e_devices: list[jax.Device],
) -> None:
    """174 new tokens at 4 query heads over 4 kv heads (87 decodes beside an 87-token chunk,
    as a serving step of Llama-2-7B at one chip): the prefill call's automatic items hold no
    more tokens than the batch (`RaggedBlocks.block_q_for`), so neither q nor the output is
    padded or laid out again around the calls."""
    tokens, q_heads, head_dim = 174, 4, 128
    text = _compiled_bf16_step(v5e_devices[0], tokens, 88, (q_heads, 4), pages=16)
    q_shape = f"bf16[{tokens},{q_heads},{head_dim}]"
    q_bytes = tokens * q_heads * head_dim * 2
    moved = [(op.name, op.shape, op.bytes) for op in hlo_ops.find_copy_trap(text)
             if op.bytes >= q_bytes // 2 and op.relayout is not False]  # fmt: skip
    assert moved == [], (q_shape, moved)


def test_a_step_at_four_kv_heads_a_chip_compiles_within_its_vmem_estimate(
    v5e_devices: list[jax.Device],
) -> None:
    """Llama-3-8B over 2 chips: 16 query heads over 4 kv heads a chip, a 448-token chunk
    beside 64 decodes. A grid step takes all 4 kv heads, items of 128 tokens and kv blocks of
    1024 positions: more than Mosaic's default scoped VMEM (16 MiB on v5e), so the kernel asks
    for its own estimate (`ragged_call.kernel_call`); without it Mosaic's
    CompileTimeScopedVmemOom."""
    text = _compiled_bf16_step(v5e_devices[0], 512, 65, (16, 4), pages=64)
    calls = sorted(op.name.split(".")[0] for op in hlo_ops.kernel_calls(text))
    assert calls == sorted([KERNEL_NAME, DECODE_KERNEL_NAME, page_write_kernel.KERNEL_NAME])
