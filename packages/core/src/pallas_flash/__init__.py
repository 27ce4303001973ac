"""Pallas-Flash: fused attention for TPU, one API over pluggable backends.

Quick start::

    import pallas_flash as pf

    out = pf.attention(q, k, v, causal=True)            # [batch, heads, seq, head_dim]
    out = pf.attention(q, k, v, backend="xla")          # pick a backend by name
    k_cache = pf.zeros_cache((batch, kv_heads, max_len, head_dim), jnp.bfloat16)
    tok = pf.decode(q1, k_cache, v_cache, lengths)      # one token against a KV cache
    tok = pf.decode(q1, k_pages, v_pages, lengths, page_table=table)  # a paged cache
    k_cache = pf.write_token(k_cache, k1, lengths)      # its keys, in place under donation
    out, cache = pf.ragged_attention(q, k, v, k_pages, v_pages, table, starts, kv_lengths)
    kv_pages = pf.pack_kv(k_pages, v_pages)             # 16-bit pages: a token written alone
    out, cache = pf.ragged_attention(q, k, v, kv_pages, None, table, starts, kv_lengths)
    pages = pf.PageAllocator.empty(batch, pages_per_sequence, num_pages)  # a page table
    [info.name for info in pf.list_backends()]
"""

from pallas_flash.api import attention, decode
from pallas_flash.backend import Backend, BackendInfo
from pallas_flash.cache_layout import cache_format, kept_format, zeros_cache
from pallas_flash.cache_write import write_token
from pallas_flash.capabilities import Capability
from pallas_flash.context_layout import from_zigzag, to_zigzag
from pallas_flash.decode_cache import DecodeCache
from pallas_flash.dot_product_attention import dot_product_attention
from pallas_flash.errors import BackendNotFoundError, InvalidInputError, UnsupportedFeatureError
from pallas_flash.hookspecs import hookimpl
from pallas_flash.kv_packing import pack_kv, unpack_kv
from pallas_flash.page_allocator import PageAllocator
from pallas_flash.quantization import dequantize_int8, quantize_int8
from pallas_flash.ragged_attention import ragged_attention
from pallas_flash.registry import get_backend, list_backends, register_plugin, unregister_plugin
from pallas_flash.specs import AttentionSpec, DecodeSpec, RaggedSpec, SegmentIds

__all__ = [
    "AttentionSpec",
    "Backend",
    "BackendInfo",
    "BackendNotFoundError",
    "Capability",
    "DecodeCache",
    "DecodeSpec",
    "InvalidInputError",
    "PageAllocator",
    "RaggedSpec",
    "SegmentIds",
    "UnsupportedFeatureError",
    "attention",
    "cache_format",
    "decode",
    "dequantize_int8",
    "dot_product_attention",
    "from_zigzag",
    "get_backend",
    "hookimpl",
    "kept_format",
    "list_backends",
    "pack_kv",
    "quantize_int8",
    "ragged_attention",
    "register_plugin",
    "to_zigzag",
    "unpack_kv",
    "unregister_plugin",
    "write_token",
    "zeros_cache",
]
