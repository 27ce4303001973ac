"""The Split-KV backend of Pallas-Flash (backend name ``splitkv``): FlashDecoding for TPU v5e.

Public API: `SplitKvBackend` (the backend), `DecodeBlocks` (its tiling), `split_kv_decode`
(decoding of validated inputs, on one device or a mesh), `KVCache` (a preallocated cache with
an in-place append), `PagedKVCache` (a page pool with a page table, page allocation and
release, and an in-place append; bfloat16 or int8), `RaggedBlocks` (the ragged attention
kernel's tiling).
"""

from pallas_flash_splitkv.backend import SplitKvBackend
from pallas_flash_splitkv.blocks import DecodeBlocks
from pallas_flash_splitkv.cache import KVCache
from pallas_flash_splitkv.decode import split_kv_decode
from pallas_flash_splitkv.paged_cache import PagedKVCache
from pallas_flash_splitkv.ragged_blocks import RaggedBlocks

__all__ = [
    "DecodeBlocks",
    "KVCache",
    "PagedKVCache",
    "RaggedBlocks",
    "SplitKvBackend",
    "split_kv_decode",
]
