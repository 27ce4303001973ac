"""The features a backend can declare, and the features a call asks for."""

from __future__ import annotations

import enum


class Capability(enum.StrEnum):
    """One feature of the attention API that a backend may implement.

    Members compare equal to their string values, so a backend may declare
    ``{"attention", "causal"}`` as well as ``{Capability.ATTENTION, Capability.CAUSAL}``.
    """

    ATTENTION = "attention"
    """``pf.attention``: prefill / training attention."""
    DECODE = "decode"
    """``pf.decode``: one query token per sequence against a KV cache."""
    RAGGED = "ragged"
    """``pf.ragged_attention``: a flat batch of new tokens from many sequences (decode tokens
    and prefill chunks mixed) against their paged cache."""
    GRAD = "grad"
    """Gradients of ``pf.attention`` with respect to q, k and v."""
    CAUSAL = "causal"
    """``causal=True`` (and ``is_causal`` of ``dot_product_attention``)."""
    GQA = "gqa"
    """Fewer kv heads than query heads (grouped-query and multi-query attention)."""
    SEGMENT_IDS = "segment_ids"
    """``segment_ids`` (and the sequence lengths of ``dot_product_attention``)."""
    SLIDING_WINDOW = "sliding_window"
    """``sliding_window`` (and ``local_window_size`` of ``dot_product_attention``)."""
    SOFTCAP = "softcap"
    """Logit soft-capping: ``scores = softcap * tanh(scores / softcap)``."""
    VALUE_HEAD_DIM = "value_head_dim"
    """v's ``head_dim`` other than q's and k's (DeepSeek's MLA: 192 for q and k, 128 for v)."""
    SINKS = "sinks"
    """``sinks``: a learned logit per query head in every row's softmax denominator."""
    BIAS = "bias"
    """An arbitrary additive bias of ``dot_product_attention``."""
    MASK = "mask"
    """An arbitrary boolean mask of ``dot_product_attention``."""
    PAGED_CACHE = "paged_cache"
    """``decode(..., page_table=...)``: a cache kept in pages (`pallas_flash.DecodeCache`)."""
    INT8_CACHE = "int8_cache"
    """``decode`` of an int8 cache with per-token scales (``k_scales``, ``v_scales``)."""
    PACKED_CACHE = "packed_cache"
    """A 16-bit paged cache with each position's key and value packed in 32-bit words
    (``v_cache=None``; `pallas_flash.kv_packing`)."""
    CONTEXT_PARALLEL = "context_parallel"
    """``attention(..., mesh=...)``: one sequence split over the devices of a mesh."""
    MULTI_DEVICE = "multi_device"
    """``decode(..., mesh=...)`` splits the cache across the devices of a mesh."""


def as_capabilities(names: object) -> frozenset[Capability]:
    """Converts an iterable of capability names to a frozenset of `Capability`.

    Raises:
      ValueError: a name is not a known capability.
    """
    result = set()
    for name in names:  # type: ignore[attr-defined]
        try:
            result.add(Capability(name))
        except ValueError:
            known = ", ".join(c.value for c in Capability)
            raise ValueError(f"unknown capability {name!r}; known capabilities: {known}") from None
    return frozenset(result)
