"""The forward and backward kernels with small blocks, so that every call spans several q
and kv blocks: partial last blocks, skipped and clamped steps, row and key sub-blocks, GQA,
rows without keys, and a backward split into query chunks.

Runs in the TPU interpreter on hosts without a TPU (out-of-range rows of partial blocks then
hold NaN, so leaks show up). Outputs, log-sum-exps and gradients are compared with a float64
reference.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import tpu
from pallas_flash.masking import positional_mask
from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_gradient_close
from pallas_flash_pallas import (
    BlockSizes,
    PallasBackend,
    flash_attention,
    flash_forward,
    flash_output,
    plugin,
)
from pallas_flash_pallas.kernels import backward

SMALL = BlockSizes(
    block_q=256,
    block_kv=128,
    block_q_compute=128,
    backward_block_q=128,
    backward_block_kv=256,
    backward_block_kv_compute=128,
)
# Blocks below the causal diagonal folded in 2 x 2 tiles of 128 rows by 128 keys.
DIAGONAL = BlockSizes(256, 256, 128, 256, 256, 128, full_block_compute=128)
CHUNKED = dataclasses.replace(SMALL, backward_chunk_blocks=1)
SPLIT = dataclasses.replace(CHUNKED, backward_split=True)
# Unmasked blocks of 1024 rows by 128 keys folded in tiles of 512 rows, the last cut 384 + 128.
CUT_TILES = dataclasses.replace(SMALL, block_q=1024, full_block_compute=512)


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
    bias: tuple[int, int] | None = None  # its (batch, heads): each the call's or 1

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

    def inputs(self) -> tuple[jax.Array, jax.Array, jax.Array, pf.SegmentIds | None]:
        """q (times ``q_scale``), k, v and segment ids."""
        q, k, v = inputs.qkv(
            self.batch,
            self.q_heads,
            self.kv_heads,
            self.q_len,
            self.kv_len,
            self.head_dim,
            self.dtype,
        )
        return (q * self.q_scale).astype(q.dtype), k, v, self.segment_ids()

    def bias_array(self) -> jax.Array | None:
        """A float32 bias ``[*self.bias, q_len, kv_len]``, ``-inf`` at a tenth of the pairs."""
        if self.bias is None:
            return None
        shape = (*self.bias, self.q_len, self.kv_len)
        hidden = np.random.default_rng(4).random(shape) < 0.1
        return jnp.where(hidden, -jnp.inf, inputs.normal(4, shape))

    def reference_options(self, ids: pf.SegmentIds | None) -> dict:
        spec = self.spec
        return dict(
            bias=self.bias_array(),
            sm_scale=spec.sm_scale,
            causal=spec.causal,
            q_offset=spec.q_offset,
            window=spec.window,
            softcap=spec.softcap,
            segment_ids=None if ids is None else (ids.q, ids.kv),
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
    out = reference.attention(q, k, v, **call.reference_options(ids))
    group = call.q_heads // call.kv_heads
    k64 = np.repeat(np.asarray(k, np.float64), group, axis=1)
    scores = np.asarray(q, np.float64) @ k64.swapaxes(-1, -2) * spec.sm_scale
    if spec.softcap is not None:
        scores = spec.softcap * np.tanh(scores / spec.softcap)
    if call.bias is not None:
        scores = scores + np.asarray(call.bias_array(), np.float64)
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
    "cut-last-tile-partial-blocks": Call(1, 2, 1, 1100, 300, 64, blocks=CUT_TILES),
    # The backward in chunks of one query block: dk and dv summed over float32 partials.
    "chunked-gqa-causal": Call(1, 4, 2, 300, 300, 64, causal=True, blocks=CHUNKED),
    "chunked-mqa-window-segments": Call(
        1, 4, 1, 330, 260, 64, window=(60, 30), segments=2, blocks=CHUNKED
    ),
    # The backward split into a dk/dv pass and a dq pass (`split_backward`).
    "split-causal-partial-blocks": Call(1, 2, 2, 600, 600, 64, causal=True, blocks=SPLIT),
    "split-gqa-window-segments-bf16": Call(
        1, 4, 2, 520, 520, 64, dtype="bfloat16", window=(100, 30), segments=2, blocks=SPLIT
    ),
    "split-mqa-softcap-q-long": Call(1, 4, 1, 400, 260, 64, softcap=5.0, blocks=SPLIT),
    # A bias (broadcast over the batch or the heads where 1) with -inf at a tenth of the pairs.
    "bias-partial-blocks-segments": Call(2, 4, 2, 300, 260, 64, segments=2, bias=(2, 4)),
    "bias-causal-diagonal": Call(2, 2, 1, 600, 600, 64, causal=True, blocks=DIAGONAL, bias=(1, 2)),
    "bias-chunked-window-bf16": Call(
        1, 4, 2, 300, 300, 64, dtype="bfloat16", window=(60, 30), blocks=CHUNKED, bias=(1, 1)
    ),
    "bias-split-causal-softcap": Call(
        1, 2, 2, 600, 600, 64, causal=True, softcap=5.0, blocks=SPLIT, bias=(1, 2)
    ),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_matches_reference(name: str) -> None:
    call = CALLS[name]
    q, k, v, ids = call.inputs()
    bias = call.bias_array()
    out, lse = flash_forward(q, k, v, ids, None, bias, spec=call.spec, block_sizes=call.blocks)
    expected_out, expected_lse = _expected(call, q, k, v, ids)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (*q.shape[:2], 1, q.shape[2])
    lse = lse[:, :, 0]
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
    # Without the log-sum-exp the kernel computes the same output.
    alone = flash_output(q, k, v, ids, None, bias, spec=call.spec, block_sizes=call.blocks)
    np.testing.assert_array_equal(np.asarray(alone.astype(jnp.float32)), out32)


@pytest.mark.parametrize("name", list(CALLS))
def test_gradients_match_reference(name: str) -> None:
    call = CALLS[name]
    q, k, v, ids = call.inputs()
    d_out = inputs.normal(3, q.shape, call.dtype)

    def attend(q, k, v, *bias):
        return flash_attention(q, k, v, ids, None, *bias or [None], call.spec, call.blocks)

    bias = () if call.bias is None else (call.bias_array(),)  # differentiated when given
    _, vjp = jax.vjp(attend, q, k, v, *bias)
    options = call.reference_options(ids)
    expected = reference.attention_vjp(q, k, v, d_out, **options)
    if bias:
        expected = (*expected, reference.bias_vjp(q, k, v, d_out, **options))
    names = ("dq", "dk", "dv", "dbias")
    for name, got, want, x in zip(names, vjp(d_out), expected, (q, k, v, *bias), strict=False):
        assert got.dtype == x.dtype and got.shape == x.shape
        assert_gradient_close(got, want, call.dtype, name=name)


@pytest.mark.parametrize(
    ("tokens", "kv_heads", "chunks", "split"),
    [
        (131_072, 16, 2, False),  # 2 chunks of 64k rows: partials 4 GiB, a quarter of v5e's
        (131_200, 16, 3, True),  # one more chunk: 6 GiB
        (196_608, 16, 3, True),  # the old cap: partials 9 GiB beside 6 GiB of arrays
        (131_072, 4, 8, False),  # GQA 16/4: chunks of 16k rows, partials a quarter as wide
        (524_288, 4, 32, True),
    ],
)
def test_the_backward_splits_when_partials_would_take_a_quarter_of_hbm(
    tokens: int, kv_heads: int, chunks: int, split: bool
) -> None:
    kv = jax.ShapeDtypeStruct((1, kv_heads, tokens, 128), jnp.bfloat16)
    v5e = tpu.GENERATIONS["v5e"]
    assert backward.split_backward(chunks, kv, kv, v5e) is split
    assert not backward.split_backward(1, kv, kv, v5e)


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
        "grad",
        "causal",
        "gqa",
        "segment_ids",
        "sliding_window",
        "softcap",
        "sinks",
        "bias",
        "mask",
        "value_head_dim",
        "context_parallel",
    }
    (backend,) = plugin.pallas_flash_backends()
    assert isinstance(backend, PallasBackend)
    assert backend.block_sizes == BlockSizes()
