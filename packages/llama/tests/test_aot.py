"""Real-sized steps compile for a v5e-4 slice with libtpu on this CPU host (no TPU needed):
the attention kernels are Mosaic calls whose operands are not copies, and state is donated.

Training: Llama-3.2-1B shapes, f32 master weights and AdamW state sharded over fsdp=4, batch
4 x 2048, remat ``save_qkv``, the ``pallas`` kernels. Decoding: Llama-3.2-1B shapes in bf16
over tensor=4, a batch of 8 with a 32k cache split over the 4 chips by kv heads or along the
sequence, ``splitkv``; and on one chip or four with an int8 paged cache.

The decoding and serving steps run their layers as a Python loop over per-layer caches, each
layer compiled on its own to the same program: the contiguous-cache decode and the engine's
step and the int8 paged decode compile `UNROLLED_LAYERS` of the model's 16 layers (every
figure checked per layer or for that many); the training step (one scan, the whole model's
memory) all 16.
"""

from __future__ import annotations

import importlib.util
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import pallas_flash as pf
from pallas_flash import row_write_kernel
from pallas_flash.interpret import INTERPRET_ENV_VAR
from pallas_flash_llama import abstract, generation
from pallas_flash_llama.config import get_config
from pallas_flash_llama.kv_cache import KVCache
from pallas_flash_llama.sharding import make_mesh
from pallas_flash_llama.train import TrainConfig, make_train_step
from pallas_flash_splitkv import paged_kernel

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu (the TPU compiler) is not installed"
)
hlo_ops = pytest.importorskip("pallas_flash_estimate.read.hlo_ops")

HBM_BYTES = 16 << 30
UNROLLED_LAYERS = 2
"""Layers of the decoding and serving steps compiled (module doc): a layer more adds the same
kernels and ops once more, and the compile time with them (16 layers: 2 minutes of the
suite's on 2 cores)."""
SMALL_COPY = 1 << 20
"""Kernel operands may be re-laid out below this (a decode step's grouped queries, 48 KiB)."""


@pytest.fixture(scope="module")
def v5e_devices() -> list[jax.Device]:
    """The four chips of a v5e 2x2 topology (no hardware needed)."""
    from pallas_flash_bench.aot import target_devices
    from pallas_flash_estimate.targets import TARGETS

    return list(target_devices(TARGETS["v5e-4"]))


@pytest.fixture(autouse=True)
def mosaic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERPRET_ENV_VAR, "0")


def _unrolled_config():
    """Llama-3.2-1B's shapes with `UNROLLED_LAYERS` layers."""
    return get_config("llama-3.2-1b").replace(layers=UNROLLED_LAYERS)


def _large_operand_copies(text: str) -> list:
    return [
        (c.name, p.name, p.bytes)
        for c, p in hlo_ops.kernel_operand_copies(text)
        if p.bytes >= SMALL_COPY
    ]


def test_the_check_finds_a_copied_kernel_operand(v5e_devices) -> None:
    """The check can fail: a query given [batch, seq, heads, dim] is transposed for the kernel."""
    mesh = make_mesh(1, 1, 1, devices=v5e_devices[:1])
    x = jax.ShapeDtypeStruct(
        (1, 2048, 16, 128), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec())
    )

    def attend(q):
        q = jnp.swapaxes(q, 1, 2)
        return pf.attention(q, q, q, causal=True, backend="pallas")

    text = jax.jit(attend).trace(x).lower(lowering_platforms=("tpu",)).compile().as_text()
    assert _large_operand_copies(text)


def test_train_step_compiles_for_a_v5e_slice(v5e_devices) -> None:
    config = get_config("llama-3.2-1b").replace(remat="save_qkv")
    mesh = make_mesh(1, 4, 1, devices=v5e_devices)
    train_config = TrainConfig()
    state = abstract.train_state(config, train_config, mesh)
    batch = abstract.batch(4, 2048, mesh)
    step = make_train_step(config, train_config, backend="pallas", mesh=mesh)
    compiled = step.trace(state, batch).lower(lowering_platforms=("tpu",)).compile()
    text = compiled.as_text()
    names = {call.name.split(".")[0] for call in hlo_ops.kernel_calls(text)}
    assert names == {"pallas_flash_forward", "pallas_flash_backward"}, names
    assert not _large_operand_copies(text)
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= 0.99 * memory.argument_size_in_bytes  # state donated
    assert memory.argument_size_in_bytes + memory.temp_size_in_bytes < HBM_BYTES


@pytest.mark.parametrize("split", ["heads", "sequence"])
def test_decode_step_compiles_for_a_v5e_slice(v5e_devices, split: str) -> None:
    """Llama-3.2-1B has head_dim 64, for which XLA's own layout of the cache would put the
    sequence axis minor and copy every layer's cache for the kernel: the steps keep it
    row-major. Split over kv heads, no collective but the tensor-parallel layers' own."""
    config = _unrolled_config()
    mesh = make_mesh(1, 1, 4, devices=v5e_devices)
    batch, max_len = 8, 32768
    params = abstract.inference_params(config, mesh)
    cache = abstract.contiguous_cache(config, batch, max_len, mesh, split=split)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=cache.lengths.sharding)
    step = generation.jitted("decode", cache, config, "splitkv", mesh)
    compiled = step.trace(params, cache, tokens).lower(lowering_platforms=("tpu",)).compile()
    text = compiled.as_text()
    calls = [call.name.split(".")[0] for call in hlo_ops.kernel_calls(text)]
    assert calls.count(paged_kernel.CONTIGUOUS_KERNEL_NAME) == config.layers
    assert calls.count(row_write_kernel.KERNEL_NAME) == 2 * config.layers  # K and V rows
    assert len(calls) == 3 * config.layers
    assert not _large_operand_copies(text)
    chip_layer_cache = batch * config.kv_heads * max_len * config.head_dim * 2 // 4
    assert not [op.name for op in hlo_ops.find_copy_trap(text) if op.bytes >= chip_layer_cache]
    _, out_cache = compiled.output_formats
    for fmt in (*out_cache.k, *out_cache.v):
        assert fmt.layout.major_to_minor == (0, 1, 2, 3)
    memory = compiled.memory_analysis()
    cache_bytes = 2 * config.layers * chip_layer_cache
    assert memory.alias_size_in_bytes >= cache_bytes  # the cache is updated in place
    assert memory.temp_size_in_bytes < chip_layer_cache
    if split == "heads":  # the attention and MLP outputs' sums (and the logits'): no merge
        collectives = hlo_ops.collectives(text)
        assert {op.opcode.removesuffix("-start") for op in collectives} == {"all-reduce"}
        assert len(collectives) <= 2 * config.layers + 1


@pytest.mark.parametrize("chips", [1, 4])
def test_paged_int8_decode_step_compiles_for_v5e(v5e_devices, chips: int) -> None:
    """Llama-3.2-1B with an int8 paged cache (8 sequences of up to 8k positions in pages of
    128), on one chip or its pages split over a v5e-4: the step allocates pages, quantizes and
    appends the new token in place (each chip its own pages, by the row-write kernel: an XLA
    ``dynamic_update_slice`` there had XLA lay one chip's int8 pools out again around it, a
    whole-pool copy each way, at 2 to 8 layers), calls the paged splitkv kernel on operands
    that are not copies, merges the chips' partials only (no collective moves a pool), and
    aliases every layer's pool and scales."""
    config = _unrolled_config()
    mesh = make_mesh(1, 1, chips, devices=v5e_devices[:chips])
    params = abstract.inference_params(config, mesh)
    batch, pages_per_sequence, page_size = 8, 64, 128
    num_pages = batch * pages_per_sequence
    pool = (num_pages, config.kv_heads, page_size, config.head_dim)
    replicated = NamedSharding(mesh, PartitionSpec())

    def struct(shape, dtype, sharding=replicated):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def pooled(shape, dtype):
        split = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
        return struct(shape, dtype, pf.cache_format(split, len(shape)))

    values = (pooled(pool, jnp.int8),) * config.layers
    scales = (pooled(pool[:3], jnp.float32),) * config.layers
    pages = pf.PageAllocator(
        struct((batch, pages_per_sequence), jnp.int32),
        struct((chips, num_pages // chips), jnp.int32),
        struct((chips,), jnp.int32),
    )
    lengths = struct((batch,), jnp.int32)
    cache = KVCache(values, values, lengths, scales, scales, pages, split="sequence")
    step = generation.jitted("decode", cache, config, "splitkv", mesh if chips > 1 else None)
    tokens = struct((batch,), jnp.int32)
    compiled = step.trace(params, cache, tokens).lower(lowering_platforms=("tpu",)).compile()
    text = compiled.as_text()
    calls = hlo_ops.kernel_calls(text)
    names = [call.name.split(".")[0] for call in calls]
    assert set(names) == {paged_kernel.PAGED_KERNEL_NAME, row_write_kernel.KERNEL_NAME}, names
    assert names.count(row_write_kernel.KERNEL_NAME) == 4 * config.layers  # K, V, their scales
    decodes = names.count(paged_kernel.PAGED_KERNEL_NAME)
    assert decodes - len(hlo_ops.conditional_kernel_calls(text)) == config.layers
    assert not _large_operand_copies(text)
    layer_pool = math.prod(pool) // chips  # int8 bytes per chip
    copies = hlo_ops.find_copy_trap(text)  # weights prefetched into VMEM move, not re-laid out
    assert not [op.name for op in copies if op.relayout is not False and op.bytes >= 1 << 20]
    chip_pages = (f"s8[{num_pages // chips},", f"f32[{num_pages // chips},")
    assert not [op.name for op in copies if op.shape.startswith(chip_pages)]
    partials = batch * config.q_heads * (config.head_dim + 1) * 4
    assert all(op.bytes <= partials for op in hlo_ops.collectives(text)), hlo_ops.collectives(text)
    _, out_cache = compiled.output_formats
    for fmt in (*out_cache.k, *out_cache.v):
        assert fmt.layout.major_to_minor == (0, 1, 2, 3)
    memory = compiled.memory_analysis()
    cache_bytes = 2 * config.layers * (layer_pool + 4 * math.prod(pool[:3]) // chips)
    assert memory.alias_size_in_bytes >= cache_bytes  # every pool and its scales in place
    # no chip holds a whole layer's pool in temporaries (26 MB on one chip, 32 MB on four)
    assert memory.temp_size_in_bytes < math.prod(pool), memory.temp_size_in_bytes


def test_the_tensor_parallel_engine_step_compiles_for_a_v5e_slice(v5e_devices) -> None:
    """The serving engine's step (`engine_step`) for Llama-3.2-1B over tensor=4, 64 slots and
    512 tokens, a pool of pages of 128 split over its kv heads: every layer attends with
    splitkv's ragged kernel, which writes its new tokens into its packed pool (keys and values
    in one uint32 array; no page write of core's), on operands that are copies of q-sized arrays at
    most (the kernel's queries laid out per work item, as
    `test_ragged_aot` bounds them), never of a pool; no collective moves a pool; every pool
    is updated in place."""
    from pallas_flash import page_write_kernel
    from pallas_flash_llama import engine_step
    from pallas_flash_splitkv import ragged_attention

    config = _unrolled_config()
    mesh = make_mesh(1, 1, 4, devices=v5e_devices)
    slots, budget, page_size, pages_per_sequence = 64, 512, 128, 64
    num_pages = slots * pages_per_sequence // 2
    params = abstract.inference_params(config, mesh)
    cache = abstract.paged_cache(config, slots, pages_per_sequence, num_pages, page_size, mesh)
    assert cache.packed and cache.k[0].dtype == jnp.uint32
    batch = abstract.step_batch(slots, budget, pages_per_sequence, mesh)
    step = engine_step.step_program(cache, config, "splitkv", mesh)
    compiled = step.trace(params, cache, batch).lower(lowering_platforms=("tpu",)).compile()
    text = compiled.as_text()
    calls = [call.name.split(".")[0] for call in hlo_ops.kernel_calls(text)]
    ragged = (ragged_attention.KERNEL_NAME, ragged_attention.DECODE_KERNEL_NAME)
    assert sum(calls.count(name) for name in ragged) == 2 * config.layers, calls
    assert page_write_kernel.KERNEL_NAME not in calls  # the ragged calls write the packed pool
    chip_q = budget * config.q_heads * config.head_dim * 2 // 4
    assert all(bytes_ <= 4 * chip_q for *_, bytes_ in _large_operand_copies(text))
    chip_pool = num_pages * config.kv_heads * page_size * config.head_dim * 2 // 4
    # the layers' all-reduces (2 MiB), the sampled logits' exchanges (16 MiB): not a pool
    assert all(op.bytes < chip_pool // 2 for op in hlo_ops.collectives(text))
    copies = hlo_ops.find_copy_trap(text)  # the sampler's logits are re-laid out; no pool
    chip_pool_shape = f"u32[{num_pages},{config.kv_heads // 4},{page_size},{config.head_dim}]"
    assert not [op.name for op in copies if op.shape.startswith(chip_pool_shape)]
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= 2 * config.layers * chip_pool  # pools in place
    assert memory.temp_size_in_bytes < chip_pool
