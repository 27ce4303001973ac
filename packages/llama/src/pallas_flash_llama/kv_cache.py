"""The generation cache: preallocated K and V buffers per layer, contiguous or paged, in the
compute dtype or int8, and each sequence's length.

Layouts (`pf.DecodeCache`), per layer:

- contiguous: ``[batch, kv_heads, max_len, head_dim]``. Over a mesh it is split one of two
  ways (`CacheSplit`): ``"heads"`` as the model splits attention, the batch over ``data`` x
  ``fsdp`` and the kv heads over ``tensor``, so each device decodes its own sequences and
  heads and nothing crosses devices (the serving layout); or ``"sequence"``, the sequence
  axis over every device, each decoding its share of every sequence and the partials merged
  across devices (Split-KV across chips, ``pf.decode``'s mesh layout: for a cache one chip
  cannot hold);
- paged: a pool ``[num_pages, kv_heads, page_size, head_dim]`` per layer; all layers share
  one page table, one allocator and the lengths (`pf.PageAllocator`), since a sequence's
  position ``p`` is in the same page of every layer's pool. Over a mesh (`pool_sharding`)
  either the pool's pages are split over all of it (``"sequence"``, the default), page ``j``
  of sequence ``b`` from device ``(j + b) % devices``, so that each device holds about ``1 /
  devices`` of every sequence; or its kv heads over ``tensor`` (``"heads"``, tensor-parallel
  serving as vLLM's: every device holds every page of its own heads, one allocator for all;
  the mesh's batch axes of size 1);
- int8 (either layout): K and V in int8 with float32 scales, the buffer's shape without
  ``head_dim`` (one per token and kv head), quantized as they are written
  (`pallas_flash.cache_write.write_kv`);
- packed (paged, 16-bit): each layer's keys and values in one uint32 pool (``k``; ``v`` None),
  a word a position's key and value (`pallas_flash.kv_packing`), so that a step's new token
  is written alone rather than with the tile of 16 positions around it.

Each layer's buffer is its own array, not a slice of a ``[layers, ...]`` stack: a kernel's
operand must be a whole buffer, and slicing a layer out of a stack would copy it (a
cache-sized copy per layer per token). Prefill and decode steps donate the cache and write it
with ``dynamic_update_slice``, so XLA updates it in place; the buffers are row-major
(`pf.zeros_cache`), the layout the kernels read, which XLA on TPU would not choose by itself
for a ``head_dim`` under 128.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_flash as pf
from pallas_flash import kv_packing, page_allocator
from pallas_flash.cache_write import write_kv, write_pages
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.sharding import BATCH_AXES, batch_parts

Layers = tuple[jax.Array, ...]

CacheSplit = Literal["heads", "sequence"]
"""How a mesh splits a cache (module doc): over kv heads (a contiguous cache: and its batch),
or along the sequence (a paged cache: its pages)."""
CACHE_SPLITS: tuple[CacheSplit, ...] = ("heads", "sequence")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer for a batch of sequences being generated (layouts in
    the module doc).

    Attributes:
      k: per layer, ``[batch, kv_heads, max_len, head_dim]``, or paged ``[num_pages,
        kv_heads, page_size, head_dim]``; the compute dtype or int8, or (packed) uint32.
      v: per layer, shaped as ``k``; None for a packed cache.
      lengths: ``[batch]`` int32 tokens cached per sequence (positions past it are unused).
      k_scales: per layer, float32 ``k``'s shape without ``head_dim`` for an int8 cache,
        else None.
      v_scales: the same for ``v``.
      pages: the page table and free pages shared by every layer of a paged cache, else
        None.
      split: how a mesh splits it (`CacheSplit`); static.
    """

    k: Layers
    v: Layers | None
    lengths: jax.Array
    k_scales: Layers | None = None
    v_scales: Layers | None = None
    pages: pf.PageAllocator | None = None
    split: CacheSplit = dataclasses.field(default="heads", metadata={"static": True})

    @property
    def paged(self) -> bool:
        """Whether the layers' K/V are pages read through ``pages.page_table``."""
        return self.pages is not None

    @property
    def quantized(self) -> bool:
        """Whether K and V are int8 with scales."""
        return self.k_scales is not None

    @property
    def packed(self) -> bool:
        """Whether each layer's K and V are one packed pool (module doc)."""
        return self.v is None

    @property
    def page_size(self) -> int | None:
        """Positions per page of a paged cache; None for a contiguous one."""
        return self.k[0].shape[2] if self.paged else None

    @property
    def max_len(self) -> int:
        """Positions one sequence can hold."""
        return self.layer(0).max_len

    def layer(self, i: int) -> pf.DecodeCache:
        """Layer ``i``'s cache as ``pf.decode`` reads it."""
        return pf.DecodeCache(
            self.k[i],
            None if self.v is None else self.v[i],
            None if self.pages is None else self.pages.page_table,
            None if self.k_scales is None else self.k_scales[i],
            None if self.v_scales is None else self.v_scales[i],
        )

    def with_layers(
        self,
        layers: Sequence[pf.DecodeCache],
        lengths: jax.Array,
        pages: pf.PageAllocator | None = None,
    ) -> KVCache:
        """This cache with every layer's buffers replaced by ``layers`` (as `layer` gives
        them), ``lengths`` and, when given, ``pages``."""

        def field(name: str) -> Layers | None:
            arrays = tuple(getattr(layer, name) for layer in layers)
            return None if arrays[0] is None else arrays

        return KVCache(
            field("k"),
            field("v"),
            lengths,
            field("k_scales"),
            field("v_scales"),
            self.pages if pages is None else pages,
            self.split,
        )


def cache_sharding(mesh: Mesh, split: CacheSplit = "heads") -> NamedSharding:
    """The placement of each layer's contiguous buffer ``[batch, kv_heads, max_len,
    head_dim]``: batch and kv heads split as the model's (``"heads"``), or the sequence axis
    over every mesh axis (``"sequence"``)."""
    if split == "heads":
        return NamedSharding(mesh, PartitionSpec(BATCH_AXES, "tensor", None, None))
    return NamedSharding(mesh, PartitionSpec(None, None, tuple(mesh.axis_names), None))


def pool_sharding(mesh: Mesh, split: CacheSplit = "sequence") -> NamedSharding:
    """The placement of each layer's pool ``[num_pages, kv_heads, page_size, head_dim]`` of a
    paged cache: pages split over every mesh axis (``"sequence"``), or kv heads over
    ``tensor`` (``"heads"``)."""
    if split == "heads":
        return NamedSharding(mesh, PartitionSpec(None, "tensor", None, None))
    return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names), None, None, None))


def write_split(mesh: Mesh | None) -> tuple[Mesh, tuple[str, ...]] | None:
    """The mesh axes that split a cache's sequence axis (contiguous, ``"sequence"``) or pages
    (paged), as `pallas_flash.cache_write` takes them; None without a mesh."""
    return None if mesh is None else (mesh, tuple(mesh.axis_names))


def check_split(split: str, paged: bool, mesh: Mesh | None = None) -> CacheSplit:
    """``split``, checked to be a `CacheSplit` that the layout takes over ``mesh``.

    Raises:
      pf.InvalidInputError: an unknown split, or a paged cache split over kv heads on a mesh
        whose batch axes split the batch (each device would own only some pages).
    """
    if split not in CACHE_SPLITS:
        raise pf.InvalidInputError(f"split: expected one of {CACHE_SPLITS}, got {split!r}")
    if paged and split == "heads" and mesh is not None and batch_parts(mesh) > 1:
        raise pf.InvalidInputError(
            "mesh: a paged cache split over kv heads takes a mesh whose data and fsdp axes are "
            f"1 (every device holds every page of its heads), got {dict(mesh.shape)}; use "
            "make_mesh(1, 1, tensor), or split='sequence'"
        )
    return split


def scales_sharding(sharding: NamedSharding | None) -> NamedSharding | None:
    """The placement of an int8 buffer's scales: the values' without ``head_dim``."""
    if sharding is None:
        return None
    return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:3]))


def init_cache(
    config: LlamaConfig,
    batch: int,
    max_len: int,
    mesh: Mesh | None = None,
    *,
    kv_dtype: str | jnp.dtype | None = None,
    page_size: int | None = None,
    num_pages: int | None = None,
    split: CacheSplit | None = None,
) -> KVCache:
    """An empty cache on the first device, or split over ``mesh`` (`cache_sharding`, or
    `pool_sharding` for a paged one).

    Args:
      config: the model (layers, kv heads, head_dim, compute dtype).
      batch: sequences.
      max_len: positions per sequence (paged: rounded up to whole pages).
      mesh: split each layer's buffer over it as ``split`` says.
      kv_dtype: of K and V: None for the compute dtype, or ``jnp.int8`` (then with scales).
        A paged cache of a 16-bit dtype is packed (module doc).
      page_size: positions per page, for a paged cache; None: contiguous.
      num_pages: pages per layer's pool (a multiple of the devices its pages are split
        over); default: enough for every sequence to reach ``max_len`` whichever device each
        page comes from, ``devices * batch * ceil(ceil(max_len / page_size) / devices)``.
      split: a `CacheSplit`; default ``"heads"`` for a contiguous cache, ``"sequence"`` for
        a paged one.

    Raises:
      pf.InvalidInputError: ``kv_dtype`` is neither a float dtype nor int8, ``page_size`` or
        ``num_pages`` is below 1, ``num_pages`` is not a multiple of the mesh's devices, or
        ``split`` is unknown or one the mesh does not take (`check_split`).
    """
    dtype = _cache_dtype(config.dtype if kv_dtype is None else kv_dtype)
    paged = page_size is not None
    default = "sequence" if paged else "heads"
    split = check_split(default if split is None else split, paged, mesh)
    pages = None
    if not paged:
        shape = (batch, config.kv_heads, max_len, config.head_dim)
        sharding = None if mesh is None else cache_sharding(mesh, split)
    else:
        if page_size < 1:
            raise pf.InvalidInputError(f"page_size: expected at least 1, got {page_size}")
        shards = 1 if mesh is None or split == "heads" else mesh.size
        per_sequence = math.ceil(max_len / page_size)
        if num_pages is None:
            num_pages = shards * batch * math.ceil(per_sequence / shards)
        if num_pages < 1:
            raise pf.InvalidInputError(f"num_pages: expected at least 1, got {num_pages}")
        pages = pf.PageAllocator.empty(batch, per_sequence, num_pages, shards)
        shape = (num_pages, config.kv_heads, page_size, config.head_dim)
        sharding = None if mesh is None else pool_sharding(mesh, split)

    def zeros(shape: tuple[int, ...], dtype: jnp.dtype, sharding) -> Layers:
        return tuple(pf.zeros_cache(shape, dtype, sharding) for _ in range(config.layers))

    scales = None
    if dtype == jnp.int8:
        scales = (shape[:3], jnp.float32, scales_sharding(sharding))
    packed = paged and kv_packing.packable(dtype)
    return KVCache(
        zeros(shape, kv_packing.PACKED_DTYPE if packed else dtype, sharding),
        None if packed else zeros(shape, dtype, sharding),
        jnp.zeros((batch,), jnp.int32),
        None if scales is None else zeros(*scales),
        None if scales is None else zeros(*scales),
        pages,
        split,
    )


def _cache_dtype(kv_dtype: str | jnp.dtype) -> jnp.dtype:
    """``kv_dtype`` as a dtype, checked to be a float dtype or int8."""
    try:
        dtype = jnp.dtype(kv_dtype)
    except TypeError:
        dtype = None
    if dtype is None or (dtype != jnp.int8 and not jnp.issubdtype(dtype, jnp.floating)):
        raise pf.InvalidInputError(
            f"kv_dtype: expected None, a float dtype or int8, got {kv_dtype!r}"
        )
    return dtype


def allocate_prompts(cache: KVCache, lengths: jax.Array) -> KVCache:
    """A paged cache with ``ceil(lengths[b] / page_size)`` pages allocated to each sequence
    (a contiguous one unchanged); the lengths are set by `fill`'s caller."""
    if not cache.paged:
        return cache
    pages, _ = page_allocator.allocate_prompts(cache.pages, lengths, cache.page_size)
    return dataclasses.replace(cache, pages=pages)


def fill(
    layer: pf.DecodeCache, k: jax.Array, v: jax.Array, mesh: Mesh | None = None
) -> pf.DecodeCache:
    """One layer's cache with a prompt batch's keys and values written from position 0 (in
    place under donation; quantized when int8).

    Args:
      layer: a contiguous layer, or a paged one whose table holds the pages the prompts take
        (`allocate_prompts`); pages the table does not hold are not written.
      k: ``[batch, kv_heads, prompt_len, head_dim]`` (``prompt_len <= max_len``).
      v: shaped as ``k``.
      mesh: the mesh a paged layer's pages are split over (each device writes its own);
        None for one whose kv heads are (XLA partitions the write along them).
    """
    page_size = layer.k.shape[2]

    def write(array: jax.Array, x: jax.Array) -> jax.Array:
        if not layer.paged:
            return jax.lax.dynamic_update_slice(array, x.astype(array.dtype), (0,) * array.ndim)
        pages = layer.page_table[:, : math.ceil(k.shape[2] / page_size)].reshape(-1)
        return write_pages(array, as_pages(x, page_size), pages, split=write_split(mesh))

    return write_kv(layer, k, v, write)


def as_pages(x: jax.Array, page_size: int) -> jax.Array:
    """``x [batch, kv_heads, length, ...]`` cut into pages ``[batch * ceil(length /
    page_size), kv_heads, page_size, ...]``, sequence-major (page ``j`` of sequence ``b`` at
    ``b * pages + j``), the last page zero-padded."""
    batch, kv_heads, length, *rest = x.shape
    count = math.ceil(length / page_size)
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, count * page_size - length)
    x = jnp.pad(x, pad).reshape(batch, kv_heads, count, page_size, *rest)
    return jnp.moveaxis(x, 2, 1).reshape(batch * count, kv_heads, page_size, *rest)


def next_slots(cache: KVCache) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
    """Where each sequence's next token goes: a page allocated first for each paged sequence
    whose pages are full (`pallas_flash.page_allocator.allocate_next`).

    Returns:
      The cache (with its allocator updated), and ``[batch]`` int32 ``blocks`` and
      ``positions`` for `pallas_flash.cache_write.write_rows` (contiguous: the sequence and
      its length; paged: the page and its row; a negative block: not written), and
      ``[batch]`` bool, the sequences that get the token (paged: not those that are full or
      found no free page; contiguous: all, the caller keeps within ``max_len``).
    """
    lengths = cache.lengths
    if not cache.paged:
        batch = lengths.shape[0]
        return cache, jnp.arange(batch, dtype=jnp.int32), lengths, jnp.ones((batch,), bool)
    active = jnp.ones(lengths.shape, bool)
    pages, page, active = page_allocator.allocate_next(
        cache.pages, lengths, active, cache.page_size
    )
    return dataclasses.replace(cache, pages=pages), page, lengths % cache.page_size, active
