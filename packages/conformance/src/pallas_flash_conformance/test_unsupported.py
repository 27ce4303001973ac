"""Every capability a backend does not declare must raise UnsupportedFeatureError.

``multi_device`` is not checked: single-device backends ignore ``decode(..., mesh=...)``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs

_Q, _K, _V = inputs.qkv(1, 2, 2, 16, 16, 64)


def _attention(backend: str, q=_Q, **kwargs):
    return pf.attention(q, _K, _V, backend=backend, **kwargs)


def _decode(backend: str, q_heads: int = 2, **kwargs):
    cache = inputs.normal(1, (1, 2, 16, 64))
    q = inputs.normal(0, (1, q_heads, 64))
    return pf.decode(q, cache, cache, np.array([16], np.int32), backend=backend, **kwargs)


def _paged(backend: str):
    pages = inputs.normal(1, (2, 2, 8, 64))  # 2 pages of 8 positions
    q = inputs.normal(0, (1, 2, 64))
    table = np.array([[1, 0]], np.int32)
    return pf.decode(q, pages, pages, np.array([16], np.int32), page_table=table, backend=backend)


def _int8(backend: str):
    values, scales = pf.quantize_int8(inputs.normal(1, (1, 2, 16, 64)))
    q = inputs.normal(0, (1, 2, 64))
    lengths = np.array([16], np.int32)
    return pf.decode(q, values, values, lengths, k_scales=scales, v_scales=scales, backend=backend)


def _packed(backend: str):
    pages = inputs.normal(1, (2, 2, 8, 64), "bfloat16")
    new = inputs.normal(2, (3, 2, 64), "bfloat16")
    table, starts, lengths = np.array([[1, 0]]), np.array([0, 3]), np.array([10])
    words = pf.pack_kv(pages, pages)
    return pf.ragged_attention(new, new, new, words, None, table, starts, lengths, backend=backend)


def _ragged(backend: str):
    pages = inputs.normal(1, (2, 2, 8, 64))
    new = inputs.normal(2, (3, 2, 64))
    table, starts, lengths = np.array([[1, 0]]), np.array([0, 3]), np.array([10])
    return pf.ragged_attention(new, new, new, pages, pages, table, starts, lengths, backend=backend)


def _grouped_query(backend: str):
    q, k, v = inputs.qkv(1, 4, 2, 16, 16, 64)
    return pf.attention(q, k, v, backend=backend)


# feature: (a call that uses it, the other capability that call needs besides it)
CALLS = {
    "attention": (_attention, None),
    "decode": (_decode, None),
    "ragged": (_ragged, None),
    "grad": (lambda b: jax.grad(lambda q: _attention(b, q=q).sum())(_Q), "attention"),
    "causal": (lambda b: _attention(b, causal=True), "attention"),
    "gqa": (_grouped_query, "attention"),
    "segment_ids": (
        lambda b: _attention(
            b, segment_ids=pf.SegmentIds(np.zeros((1, 16), np.int32), np.zeros((1, 16), np.int32))
        ),
        "attention",
    ),
    "sliding_window": (lambda b: _attention(b, sliding_window=4), "attention"),
    "softcap": (lambda b: _attention(b, softcap=5.0), "attention"),
    "sinks": (lambda b: _attention(b, sinks=np.zeros((2,), np.float32)), "attention"),
    "context_parallel": (
        lambda b: _attention(b, mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))),
        "attention",
    ),
    "value_head_dim": (
        lambda b: pf.attention(_Q, _K, inputs.normal(2, (1, 2, 16, 128)), backend=b),
        "attention",
    ),
    "paged_cache": (_paged, "decode"),
    "int8_cache": (_int8, "decode"),
    "packed_cache": (_packed, "ragged"),
    "bias": (
        lambda b: pf.dot_product_attention(
            *_swapped(), bias=np.zeros((1, 2, 16, 16), np.float32), implementation=b
        ),
        "attention",
    ),
    "mask": (
        lambda b: pf.dot_product_attention(
            *_swapped(), mask=np.ones((1, 2, 16, 16), bool), implementation=b
        ),
        "attention",
    ),
}


def _swapped():
    return [x.swapaxes(1, 2) for x in (_Q, _K, _V)]


def test_every_capability_but_multi_device_is_covered() -> None:
    assert set(CALLS) == {c.value for c in pf.Capability} - {"multi_device"}


@pytest.mark.parametrize("feature", sorted(CALLS))
def test_undeclared_feature_raises(backend, feature: str) -> None:
    call, needs = CALLS[feature]
    if feature in backend.capabilities:
        pytest.skip(f"{backend.name} declares {feature}")
    if needs is not None and needs not in backend.capabilities:
        pytest.skip(f"{backend.name} does not declare {needs}, checked on its own")
    with pytest.raises(pf.UnsupportedFeatureError, match=feature):
        call(backend.name)
