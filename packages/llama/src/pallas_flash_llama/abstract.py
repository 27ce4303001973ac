"""Abstract arguments of the train, prefill and decode steps and the serving engine's step:
``jax.ShapeDtypeStruct``s with their shardings, to compile a step ahead of time for a TPU
slice this host does not have (``step.trace(*args).lower(lowering_platforms=("tpu",))
.compile()``).

The mesh may be made of a topology's devices (``jax.experimental.topologies``); nothing here
allocates memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_flash as pf
from pallas_flash import kv_packing
from pallas_flash_llama import generation, int8_weights, model
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.engine_step import StepBatch
from pallas_flash_llama.kv_cache import (
    CacheSplit,
    KVCache,
    cache_sharding,
    check_split,
    pool_sharding,
    scales_sharding,
)
from pallas_flash_llama.sharding import BATCH_AXES, param_shardings
from pallas_flash_llama.train import Batch, TrainConfig, TrainState


def _structs(shapes, shardings, dtype) -> dict:
    return jax.tree.map(
        lambda shape, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding),
        shapes,
        shardings,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def params(config: LlamaConfig, mesh: Mesh) -> dict:
    """The stacked parameters (`model.param_shapes`) in ``config.param_dtype``, sharded by
    `sharding.param_shardings`."""
    shapes = model.param_shapes(config)
    return _structs(shapes, param_shardings(config, mesh), jnp.dtype(config.param_dtype))


def train_state(config: LlamaConfig, train_config: TrainConfig, mesh: Mesh) -> TrainState:
    """The `TrainState`: parameters, the optimiser state (in their shardings) and the step."""
    stacked = params(config, mesh)
    opt_state = jax.eval_shape(train_config.optimizer().init, stacked)
    return TrainState(stacked, opt_state, jax.ShapeDtypeStruct((), jnp.int32))


def batch(size: int, seq_len: int, mesh: Mesh) -> Batch:
    """``tokens`` and ``segment_ids`` ``[size, seq_len]`` int32, split over the batch axes."""
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))
    return {
        name: jax.ShapeDtypeStruct((size, seq_len), jnp.int32, sharding=rows)
        for name in ("tokens", "segment_ids")
    }


def inference_params(config: LlamaConfig, mesh: Mesh, weights: str | None = None) -> dict:
    """`generation.inference_params`: the compute dtype (``weights="int8"``: the matmul
    weights `int8_weights.quantize_params`'s), one dict per layer, each array in its stacked
    parameter's sharding less the layer axis."""
    if weights not in (None, "int8"):
        raise pf.InvalidInputError(f"weights: expected None or 'int8', got {weights!r}")
    source = params(config, mesh)
    stacked = param_shardings(config, mesh)
    if weights == "int8":
        source = jax.eval_shape(int8_weights.quantize_params, source)
        stacked = int8_weights.shardings(config, mesh)
    shapes = jax.eval_shape(lambda p: generation.inference_params(p, config), source)

    def struct(x: jax.ShapeDtypeStruct, placed: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed)

    def unstacked(x: jax.ShapeDtypeStruct, placed: NamedSharding) -> jax.ShapeDtypeStruct:
        return struct(x, NamedSharding(mesh, PartitionSpec(*placed.spec[1:])))

    out = {name: jax.tree.map(struct, x, stacked[name]) for name, x in shapes.items()
           if name != "layers"}  # fmt: skip
    out["layers"] = [jax.tree.map(unstacked, layer, stacked["layers"])
                     for layer in shapes["layers"]]  # fmt: skip
    return out


def contiguous_cache(
    config: LlamaConfig,
    size: int,
    max_len: int,
    mesh: Mesh,
    kv_dtype: str | None = None,
    split: CacheSplit = "heads",
) -> KVCache:
    """A contiguous `KVCache` of ``size`` sequences of ``max_len`` positions, each layer's
    buffer split over the mesh as ``split`` says (`kv_cache.cache_sharding`) and laid out
    row-major (`pf.cache_format`); int8 with float32 scales when ``kv_dtype`` says so."""
    shape = (size, config.kv_heads, max_len, config.head_dim)
    placed = cache_sharding(mesh, check_split(split, paged=False))
    layers, scales = _layer_buffers(config, shape, placed, kv_dtype)
    replicated = NamedSharding(mesh, PartitionSpec())
    lengths = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=replicated)
    return KVCache(layers, layers, lengths, scales, scales, split=split)


def _layer_buffers(config: LlamaConfig, shape: tuple[int, ...], placed: NamedSharding,
                   kv_dtype: str | None) -> tuple[tuple, tuple | None]:  # fmt: skip
    """Every layer's K (or V) buffer of ``shape`` placed row-major as ``placed`` says, and its
    float32 scales (the shape without ``head_dim``) when ``kv_dtype`` is int8, else None."""
    dtype = jnp.dtype(config.dtype if kv_dtype is None else kv_dtype)
    layer = jax.ShapeDtypeStruct(shape, dtype, sharding=pf.cache_format(placed))
    if dtype != jnp.int8:
        return (layer,) * config.layers, None
    scale_format = pf.cache_format(scales_sharding(placed), 3)
    scale = jax.ShapeDtypeStruct(shape[:3], jnp.float32, sharding=scale_format)
    return (layer,) * config.layers, (scale,) * config.layers


def paged_cache(
    config: LlamaConfig,
    slots: int,
    pages_per_sequence: int,
    num_pages: int,
    page_size: int,
    mesh: Mesh,
    kv_dtype: str | None = None,
) -> KVCache:
    """A paged `KVCache` as the serving engine holds it over a ``(1, 1, tensor)`` mesh
    (`kv_cache.init_cache`, ``split="heads"``): each layer's pool ``[num_pages, kv_heads,
    page_size, head_dim]`` split over its kv heads and row-major, int8 with float32 scales
    when ``kv_dtype`` says so, one packed uint32 pool of keys and values when 16-bit
    (`kv_cache.KVCache`); the page table of ``slots`` rows, the allocator and the lengths on
    every device."""
    check_split("heads", paged=True, mesh=mesh)
    shape = (num_pages, config.kv_heads, page_size, config.head_dim)
    dtype = jnp.dtype(config.dtype if kv_dtype is None else kv_dtype)
    packed = kv_packing.packable(dtype)
    placed = pool_sharding(mesh, "heads")
    layers, scales = _layer_buffers(config, shape, placed, kv_packing.PACKED_DTYPE if packed
                                    else kv_dtype)  # fmt: skip
    replicated = NamedSharding(mesh, PartitionSpec())

    def whole(shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)

    pages = pf.PageAllocator(whole((slots, pages_per_sequence)), whole((1, num_pages)), whole((1,)))
    values = None if packed else layers
    return KVCache(layers, values, whole((slots,)), scales, scales, pages, split="heads")


def step_batch(slots: int, token_budget: int, pages_per_sequence: int, mesh: Mesh) -> StepBatch:
    """The serving engine's step inputs (`engine_step.StepBatch`) for ``slots`` rows of
    ``pages_per_sequence`` pages and ``token_budget`` tokens, on every device."""
    replicated = NamedSharding(mesh, PartitionSpec())
    empty = StepBatch.empty(slots, token_budget, pages_per_sequence)
    return StepBatch(*(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
                       for x in empty))  # fmt: skip


def prompts(size: int, prompt_len: int, mesh: Mesh) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The prefill step's ``tokens [size, prompt_len]`` and ``lengths [size]``, replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return (
        jax.ShapeDtypeStruct((size, prompt_len), jnp.int32, sharding=replicated),
        jax.ShapeDtypeStruct((size,), jnp.int32, sharding=replicated),
    )
