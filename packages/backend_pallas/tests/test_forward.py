"""The forward kernel with small blocks, so that every call spans several q and kv blocks:
partial last blocks, skipped and clamped kv steps, row sub-blocks, GQA, rows without keys.

Runs in the TPU interpreter on hosts without a TPU (out-of-range rows of partial blocks then
hold NaN, so leaks show up). Outputs and log-sum-exps are compared with a float64 reference.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash.masking import positional_mask
from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.parity import FORWARD_TOLERANCE
from pallas_flash_pallas import BlockSizes, PallasBackend, flash_forward, plugin

SMALL = BlockSizes(block_q=256, block_kv=128, block_q_compute=128)
DIAGONAL = BlockSizes(block_q=256, block_kv=256, block_q_compute=128)


@dataclasses.dataclass(frozen=True)
class Call:
    """Shapes ``(batch, q_heads, kv_heads, q_len, kv_len, head_dim)`` and the spec's options."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str = "float32"
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float | None = None
    q_offset: int | None = None  # default: kv_len - q_len (end-aligned, as pf.attention)
    segments: int | None = None
    q_scale: float = 1.0
    blocks: BlockSizes = SMALL

    @property
    def spec(self) -> pf.AttentionSpec:
        offset = self.kv_len - self.q_len if self.q_offset is None else self.q_offset
        return pf.AttentionSpec(
            sm_scale=self.head_dim**-0.5,
            causal=self.causal,
            q_offset=offset,
            window=self.window,
            softcap=self.softcap,
        )

    def segment_ids(self) -> pf.SegmentIds | None:
        if self.segments is None:
            return None
        return pf.SegmentIds(
            jnp.asarray(inputs.segment_ids(1, self.batch, self.q_len, self.segments)),
            jnp.asarray(inputs.segment_ids(1, self.batch, self.kv_len, self.segments)),
        )


def _expected(call: Call, q, k, v, ids) -> tuple[np.ndarray, np.ndarray]:
    """Float64 output and log-sum-exp (``-inf`` for rows that see no key)."""
    spec = call.spec
    options = dict(
        sm_scale=spec.sm_scale,
        causal=spec.causal,
        q_offset=spec.q_offset,
        window=spec.window,
        softcap=spec.softcap,
        segment_ids=None if ids is None else (ids.q, ids.kv),
    )
    out = reference.attention(q, k, v, **options)
    group = call.q_heads // call.kv_heads
    k64 = np.repeat(np.asarray(k, np.float64), group, axis=1)
    scores = np.asarray(q, np.float64) @ k64.swapaxes(-1, -2) * spec.sm_scale
    if spec.softcap is not None:
        scores = spec.softcap * np.tanh(scores / spec.softcap)
    visible = np.ones(scores.shape, bool)
    mask = positional_mask(np.arange(call.q_len)[:, None], np.arange(call.kv_len)[None, :], spec)
    if mask is not None:
        visible &= np.asarray(mask)
    if ids is not None:
        visible &= (np.asarray(ids.q)[:, :, None] == np.asarray(ids.kv)[:, None, :])[:, None]
    scores = np.where(visible, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    shift = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        lse = np.log(np.exp(scores - shift).sum(axis=-1)) + shift[..., 0]
    return out, lse


CALLS = {
    "gqa-partial-blocks": Call(1, 4, 2, 300, 260, 64),
    "causal-more-queries-than-keys": Call(1, 2, 2, 300, 140, 64, causal=True),
    "causal-fewer-queries-bf16": Call(2, 2, 1, 130, 400, 128, dtype="bfloat16", causal=True),
    "window-start-aligned": Call(1, 2, 2, 400, 300, 64, window=(40, 20), q_offset=0),
    "causal-window-d96": Call(1, 2, 2, 390, 390, 96, causal=True, window=(100, 0)),
    "all-features": Call(
        2, 4, 2, 300, 300, 64, causal=True, window=(150, 0), softcap=5.0, segments=3
    ),
    "large-logits": Call(1, 2, 2, 260, 300, 64, q_scale=100.0),
    "d256": Call(1, 1, 1, 200, 300, 256, dtype="bfloat16"),
    # Diagonal blocks whose row sub-blocks stop at their last row's key.
    "causal-diagonal": Call(1, 2, 1, 600, 600, 64, causal=True, blocks=DIAGONAL),
    "causal-diagonal-offset-bf16": Call(
        1, 2, 2, 344, 600, 128, dtype="bfloat16", causal=True, segments=2, blocks=DIAGONAL
    ),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_matches_reference(name: str) -> None:
    call = CALLS[name]
    q, k, v = inputs.qkv(
        call.batch,
        call.q_heads,
        call.kv_heads,
        call.q_len,
        call.kv_len,
        call.head_dim,
        call.dtype,
    )
    q = (q * call.q_scale).astype(q.dtype)
    ids = call.segment_ids()
    out, lse = flash_forward(q, k, v, ids, spec=call.spec, block_sizes=call.blocks)
    expected_out, expected_lse = _expected(call, q, k, v, ids)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out32).all()
    tolerance = FORWARD_TOLERANCE[call.dtype] * (10 if call.q_scale > 1 else 1)
    np.testing.assert_allclose(out32, expected_out, atol=tolerance, rtol=tolerance)
    lse = np.asarray(lse)
    assert (np.isneginf(lse) == np.isneginf(expected_lse)).all()
    seen = np.isfinite(expected_lse)
    np.testing.assert_allclose(lse[seen], expected_lse[seen], rtol=1e-5, atol=1e-4)
    unseen = ~seen[..., None] & np.ones(out32.shape, bool)
    assert (out32[unseen] == 0).all(), "rows that see no key must be exactly zero"


def test_runs_inside_jit() -> None:
    """Under an outer jit the kernel's own jit is nested (and takes no compiler options)."""
    q, k, v = inputs.qkv(2, 2, 1, 40, 72, 64)
    expected = pf.attention(q, k, v, causal=True, backend="xla")
    jitted = jax.jit(lambda q, k, v: pf.attention(q, k, v, causal=True, backend="pallas"))
    np.testing.assert_allclose(jitted(q, k, v), expected, atol=2e-5, rtol=2e-5)


def test_registered_as_the_tpu_backend() -> None:
    info = {i.name: i for i in pf.list_backends()}["pallas"]
    assert info.distribution == "pallas-flash-pallas"
    assert importlib.metadata.version(info.distribution)
    assert info.platforms == {"tpu"}
    assert info.priority == 100
    assert info.capabilities == {
        "attention",
        "causal",
        "gqa",
        "segment_ids",
        "sliding_window",
        "softcap",
    }
    (backend,) = plugin.pallas_flash_backends()
    assert isinstance(backend, PallasBackend)
    assert backend.block_sizes == BlockSizes()


def test_gradient_is_not_supported() -> None:
    q, k, v = inputs.qkv(1, 2, 2, 16, 16, 64)
    with pytest.raises(pf.UnsupportedFeatureError, match="grad"):
        jax.grad(lambda q: pf.attention(q, k, v, backend="pallas").sum())(q)
