"""Ahead-of-time compilation of decode for a TPU v5e chip and a v5e-4 slice by the real
compilers (libtpu; no TPU needed, skipped without it).

One chip: one decode kernel, nothing that copies or re-lays-out the cache (the partials, a few
KiB, may be), no cache-sized temporary.
Four chips (``shard_map`` over the 2x2 topology): each chip's program holds a quarter of the
cache, and its collectives carry only ``[batch, q_heads, head_dim]``-sized partials.
A ``head_dim`` 64 cache is copied for the kernel in XLA's default layout, never in
`pf.cache_format`'s.
"""

from __future__ import annotations

import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_flash as pf
from pallas_flash import row_write_kernel
from pallas_flash_estimate.read import hlo, hlo_ops
from pallas_flash_splitkv import KVCache, paged_kernel

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason="libtpu (the TPU compiler) is not installed",
    ),
    pytest.mark.usefixtures("mosaic"),
]

BATCH, Q_HEADS, KV_HEADS, MAX_LEN, HEAD_DIM = 2, 32, 8, 32768, 128


def _compile(mesh: Mesh, cache_spec: PartitionSpec, use_mesh: bool) -> jax.stages.Compiled:
    replicated = NamedSharding(mesh, PartitionSpec())
    cache = NamedSharding(mesh, cache_spec)
    args = (
        jax.ShapeDtypeStruct((BATCH, Q_HEADS, HEAD_DIM), jnp.bfloat16, sharding=replicated),
        jax.ShapeDtypeStruct((BATCH, KV_HEADS, MAX_LEN, HEAD_DIM), jnp.bfloat16, sharding=cache),
        jax.ShapeDtypeStruct((BATCH, KV_HEADS, MAX_LEN, HEAD_DIM), jnp.bfloat16, sharding=cache),
        jax.ShapeDtypeStruct((BATCH,), jnp.int32, sharding=replicated),
    )

    def decode(q, k_cache, v_cache, lengths):
        mesh_arg = mesh if use_mesh else None
        return pf.decode(q, k_cache, v_cache, lengths, backend="splitkv", mesh=mesh_arg)

    lowered = jax.jit(decode).trace(*args).lower(lowering_platforms=("tpu",))
    return lowered.compile()


PARTIAL_BYTES = BATCH * Q_HEADS * (HEAD_DIM + 1) * 4
"""A float32 output and log-sum-exp per query head: what may be copied or exchanged."""


def _large_relayouts(text: str, partial_bytes: int = PARTIAL_BYTES) -> list[hlo.HloOp]:
    trap = hlo_ops.find_copy_trap(text)
    return [op for op in trap if op.relayout is not False and op.bytes > partial_bytes]


def _collective_bytes(text: str) -> list[int]:
    return [op.bytes for op in hlo_ops.collectives(text)]


def test_one_chip(v5e_devices: list[jax.Device]) -> None:
    mesh = Mesh(np.array(v5e_devices[:1]), ("kv",))
    compiled = _compile(mesh, PartitionSpec(), use_mesh=False)
    text = compiled.as_text()
    names = [op.name.split(".")[0] for op in hlo_ops.kernel_calls(text)]
    assert names == [paged_kernel.CONTIGUOUS_KERNEL_NAME]
    assert not _large_relayouts(text)
    assert not _collective_bytes(text)
    cache_bytes = BATCH * KV_HEADS * MAX_LEN * HEAD_DIM * 2
    assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes // 64


def test_four_chips_hold_a_quarter_each_and_exchange_only_partials(
    v5e_devices: list[jax.Device],
) -> None:
    mesh = Mesh(np.array(v5e_devices), ("kv",))
    compiled = _compile(mesh, PartitionSpec(None, None, "kv", None), use_mesh=True)
    text = compiled.as_text()
    assert len(hlo_ops.kernel_calls(text)) == 1
    quarter = f"bf16[{BATCH},{KV_HEADS},{MAX_LEN // 4},{HEAD_DIM}]"
    params = [op for op in hlo.parse_entry(text) if op.opcode == "parameter"]
    assert sum(op.shape.startswith(quarter) for op in params) == 2, params
    collectives = _collective_bytes(text)
    assert collectives, "the partials must be merged across the chips"
    assert max(collectives) <= PARTIAL_BYTES, collectives
    assert not _large_relayouts(text)


@pytest.mark.parametrize("row_major", [True, False], ids=["cache_format", "xla_default"])
def test_a_head_dim_64_cache_is_decoded_in_place_only_row_major(
    v5e_devices: list[jax.Device], row_major: bool
) -> None:
    """XLA's default layout of a ``head_dim`` 64 cache puts the sequence axis minor, so a
    decode step (append, then decode) copies the whole cache for the kernel; a cache kept in
    `pf.cache_format` is written and read in place."""
    sharding = jax.sharding.SingleDeviceSharding(v5e_devices[0])
    shape = (BATCH, KV_HEADS, MAX_LEN, 64)
    placed = pf.cache_format(sharding) if row_major else sharding
    side = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=placed)
    cache = KVCache(side, side, jax.ShapeDtypeStruct((BATCH,), jnp.int32, sharding=sharding))
    new = jax.ShapeDtypeStruct((BATCH, KV_HEADS, 64), jnp.bfloat16, sharding=sharding)
    q = jax.ShapeDtypeStruct((BATCH, Q_HEADS, 64), jnp.bfloat16, sharding=sharding)

    def step(cache: KVCache, k_new: jax.Array, v_new: jax.Array, q: jax.Array):
        cache = cache.append(k_new, v_new)
        return cache.decode(q, backend="splitkv"), cache

    kept = pf.cache_format(sharding) if row_major else None
    jitted = jax.jit(step, donate_argnums=0, out_shardings=(None, KVCache(kept, kept, None)))
    compiled = jitted.trace(cache, new, new, q).lower(lowering_platforms=("tpu",)).compile()
    side_bytes = math.prod(shape) * 2
    copies = [
        op.name for op in hlo_ops.find_copy_trap(compiled.as_text()) if op.bytes >= side_bytes
    ]
    assert bool(copies) != row_major, copies
    if row_major:
        assert compiled.memory_analysis().alias_size_in_bytes >= 2 * side_bytes


def test_int8_cache_over_four_chips_holds_a_quarter_of_values_and_scales(
    v5e_devices: list[jax.Device],
) -> None:
    mesh = Mesh(np.array(v5e_devices), ("kv",))
    values = NamedSharding(mesh, PartitionSpec(None, None, "kv", None))
    scales = NamedSharding(mesh, PartitionSpec(None, None, "kv"))
    replicated = NamedSharding(mesh, PartitionSpec())
    cache = jax.ShapeDtypeStruct((BATCH, KV_HEADS, MAX_LEN, HEAD_DIM), jnp.int8, sharding=values)
    scale = jax.ShapeDtypeStruct((BATCH, KV_HEADS, MAX_LEN), jnp.float32, sharding=scales)
    q = jax.ShapeDtypeStruct((BATCH, Q_HEADS, HEAD_DIM), jnp.bfloat16, sharding=replicated)
    lengths = jax.ShapeDtypeStruct((BATCH,), jnp.int32, sharding=replicated)

    def decode(q, k, v, lengths, k_scales, v_scales):
        return pf.decode(
            q, k, v, lengths, k_scales=k_scales, v_scales=v_scales, backend="splitkv", mesh=mesh
        )

    args = (q, cache, cache, lengths, scale, scale)
    text = jax.jit(decode).trace(*args).lower(lowering_platforms=("tpu",)).compile().as_text()
    assert len(hlo_ops.kernel_calls(text)) == 1
    params = [op.shape for op in hlo.parse_entry(text) if op.opcode == "parameter"]
    quarter = f"[{BATCH},{KV_HEADS},{MAX_LEN // 4}"
    assert sum(s.startswith(f"s8{quarter},{HEAD_DIM}]") for s in params) == 2, params
    assert sum(s.startswith(f"f32{quarter}]") for s in params) == 2, params
    assert max(_collective_bytes(text)) <= PARTIAL_BYTES
    assert not _large_relayouts(text)


def test_an_int8_paged_serving_step_updates_the_pool_in_place(
    v5e_devices: list[jax.Device],
) -> None:
    """Append (allocating pages, quantizing) then decode, jitted with the cache donated, at
    batch 32 x 8k positions in pages of 128: the rows written by the row-write kernel (K, V
    and their scales), one decode kernel, the pool aliased in place, nothing pool-sized
    copied or allocated."""
    from pallas_flash_splitkv import PagedKVCache

    batch, pages_per_sequence, page_size = 32, 64, 128
    num_pages = batch * pages_per_sequence
    device = jax.sharding.SingleDeviceSharding(v5e_devices[0])

    def struct(shape, dtype, row_major=True):
        placed = pf.cache_format(device, len(shape)) if row_major else device
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    pool, scales = (num_pages, KV_HEADS, page_size, HEAD_DIM), (num_pages, KV_HEADS, page_size)
    cache = PagedKVCache(
        struct(pool, jnp.int8), struct(pool, jnp.int8),
        struct(scales, jnp.float32), struct(scales, jnp.float32),
        struct((batch, pages_per_sequence), jnp.int32, False),
        struct((batch,), jnp.int32, False),
        struct((1, num_pages), jnp.int32, False),
        struct((1,), jnp.int32, False),
    )  # fmt: skip
    new = struct((batch, KV_HEADS, HEAD_DIM), jnp.bfloat16, False)
    q = struct((batch, Q_HEADS, HEAD_DIM), jnp.bfloat16, False)

    def step(cache: PagedKVCache, k_new, v_new, q):
        cache = cache.append(k_new, v_new)
        return cache.decode(q, backend="splitkv"), cache

    kept, kept_scales = pf.cache_format(device, 4), pf.cache_format(device, 3)
    out_cache = PagedKVCache(kept, kept, kept_scales, kept_scales, None, None, None, None)
    jitted = jax.jit(step, donate_argnums=0, out_shardings=(None, out_cache))
    compiled = jitted.trace(cache, new, new, q).lower(lowering_platforms=("tpu",)).compile()
    text = compiled.as_text()
    names = [op.name.split(".")[0] for op in hlo_ops.kernel_calls(text)]
    assert names == [row_write_kernel.KERNEL_NAME] * 4 + [paged_kernel.PAGED_KERNEL_NAME]
    pool_bytes = math.prod(pool)
    assert not [op.name for op in hlo_ops.find_copy_trap(text) if op.bytes >= pool_bytes // 64]
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= 2 * pool_bytes
    assert memory.temp_size_in_bytes < pool_bytes // 16


def test_a_packed_pool_is_decoded_by_the_paged_kernel_in_place(
    v5e_devices: list[jax.Device],
) -> None:
    """A packed bfloat16 pool (keys and values in one uint32 array) at batch 32 x 8k positions
    in pages of 128: one paged decode kernel reads it, nothing pool-sized copied or
    allocated."""
    batch, pages_per_sequence, page_size = 32, 64, 128
    num_pages = batch * pages_per_sequence
    device = jax.sharding.SingleDeviceSharding(v5e_devices[0])
    pool = (num_pages, KV_HEADS, page_size, HEAD_DIM)
    words = jax.ShapeDtypeStruct(pool, jnp.uint32, sharding=pf.cache_format(device, 4))
    q = jax.ShapeDtypeStruct((batch, Q_HEADS, HEAD_DIM), jnp.bfloat16, sharding=device)
    table = jax.ShapeDtypeStruct((batch, pages_per_sequence), jnp.int32, sharding=device)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=device)

    def decode(q, words, lengths, table):
        return pf.decode(q, words, None, lengths, page_table=table, backend="splitkv")

    lowered = jax.jit(decode).trace(q, words, lengths, table).lower(lowering_platforms=("tpu",))
    compiled = lowered.compile()
    text = compiled.as_text()
    names = [op.name.split(".")[0] for op in hlo_ops.kernel_calls(text)]
    assert names == [paged_kernel.PAGED_KERNEL_NAME]
    pool_bytes = math.prod(pool) * 4
    assert not [op.name for op in hlo_ops.find_copy_trap(text) if op.bytes >= pool_bytes // 64]
    assert compiled.memory_analysis().temp_size_in_bytes < pool_bytes // 16


def test_a_paged_int8_pool_over_four_chips_holds_a_quarter_and_appends_locally(
    v5e_devices: list[jax.Device],
) -> None:
    """A pool split along its pages over the 2x2 slice: each chip's decode program holds a
    quarter of the pages and scales, runs one kernel (and a second only for sequences holding
    more than their quarter of the table here) and exchanges only partials; the append writes
    each row on the chip holding its page, in place, with no collective."""
    from pallas_flash_splitkv import PagedKVCache
    from pallas_flash_splitkv.paged_cache import _append_step

    batch, pages_per_sequence, page_size = 8, 256, 128
    num_pages = batch * pages_per_sequence
    mesh = Mesh(np.array(v5e_devices), ("kv",))
    pages = NamedSharding(mesh, PartitionSpec("kv"))  # values and scales alike
    replicated = NamedSharding(mesh, PartitionSpec())

    def struct(shape, dtype, sharding=replicated):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    pool, scale = (num_pages, KV_HEADS, page_size, HEAD_DIM), (num_pages, KV_HEADS, page_size)
    cache = PagedKVCache(
        struct(pool, jnp.int8, pages), struct(pool, jnp.int8, pages),
        struct(scale, jnp.float32, pages), struct(scale, jnp.float32, pages),
        struct((batch, pages_per_sequence), jnp.int32),
        struct((batch,), jnp.int32),
        struct((4, num_pages // 4), jnp.int32),
        struct((4,), jnp.int32),
    )  # fmt: skip
    q = struct((batch, Q_HEADS, HEAD_DIM), jnp.bfloat16)

    def decode(cache: PagedKVCache, q):
        return cache.decode(q, backend="splitkv", mesh=mesh)

    text = jax.jit(decode).trace(cache, q).lower(lowering_platforms=("tpu",)).compile().as_text()
    kernels = {op.name for op in hlo_ops.kernel_calls(text)}
    assert len(kernels) == 2 and len(hlo_ops.conditional_kernel_calls(text)) == 1  # the second pass
    params = [op.shape for op in hlo.parse_entry(text) if op.opcode == "parameter"]
    quarter = f"[{num_pages // 4},{KV_HEADS},{page_size}"
    assert sum(s.startswith(f"s8{quarter},{HEAD_DIM}]") for s in params) == 2, params
    assert sum(s.startswith(f"f32{quarter}]") for s in params) == 2, params
    partial_bytes = batch * Q_HEADS * (HEAD_DIM + 1) * 4
    assert max(_collective_bytes(text)) <= partial_bytes
    assert not _large_relayouts(text, partial_bytes)

    step = _append_step(pf.cache_format(pages, 4), pf.cache_format(pages, 3), (mesh, ("kv",)))
    new = struct((batch, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    active = struct((batch,), jnp.bool_)
    compiled = step.trace(cache, new, new, active).lower(lowering_platforms=("tpu",)).compile()
    assert not hlo_ops.collectives(compiled.as_text())
    assert compiled.memory_analysis().alias_size_in_bytes >= 2 * math.prod(pool) // 4
