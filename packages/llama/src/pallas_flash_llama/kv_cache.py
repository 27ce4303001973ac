"""The generation cache: one preallocated K and V buffer per layer, and each sequence's length.

Each layer's ``[batch, kv_heads, max_len, head_dim]`` buffer is its own array, not a slice of
a ``[layers, ...]`` stack: a kernel's operand must be a whole buffer, and slicing a layer out
of a stack would copy it (a cache-sized copy per layer per token). Prefill and decode steps
donate the cache and write it with ``dynamic_update_slice``, so XLA updates it in place; the
buffers are row-major (`pf.zeros_cache`), the layout the kernels read, which XLA on TPU
would not choose by itself for a ``head_dim`` under 128.
With a mesh the sequence axis is split over all its devices, as ``pf.decode`` expects.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_flash as pf
from pallas_flash_llama.config import LlamaConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer for a batch of sequences being generated.

    Attributes:
      k: per layer, ``[batch, kv_heads, max_len, head_dim]``.
      v: per layer, ``[batch, kv_heads, max_len, head_dim]``.
      lengths: ``[batch]`` int32 tokens cached per sequence (positions past it are unused).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """The placement of each layer's buffer: sequence axis split over every mesh axis."""
    return NamedSharding(mesh, PartitionSpec(None, None, tuple(mesh.axis_names), None))


def init_cache(config: LlamaConfig, batch: int, max_len: int, mesh: Mesh | None = None) -> KVCache:
    """A zero cache of ``max_len`` positions per sequence in the compute dtype, lengths 0,
    on the first device or split over ``mesh`` (`cache_sharding`)."""
    shape = (batch, config.kv_heads, max_len, config.head_dim)
    sharding = None if mesh is None else cache_sharding(mesh)

    def zeros() -> tuple[jax.Array, ...]:
        return tuple(pf.zeros_cache(shape, config.dtype, sharding) for _ in range(config.layers))

    return KVCache(zeros(), zeros(), jnp.zeros((batch,), jnp.int32))
