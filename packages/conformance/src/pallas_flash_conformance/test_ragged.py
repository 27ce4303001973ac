"""Ragged attention (``pf.ragged_attention``) against the float64 reference: flat batches of
decode tokens and prefill chunks from many sequences over one paged cache.

Pages are handed out in shuffled order; every pool slot that holds no cached position before
the call is NaN (a kernel that reads a position past a sequence's length, or another
sequence's page, fails). The mixes cover all decode, all prefill, both at once, empty
sequences, padding rows and chunks that cross pages. Each test also checks the cache the call
returns: the new keys and values at their sequences' positions and nothing else changed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close

pytestmark = pytest.mark.requires("ragged")

PAGE_SIZE, PAGES_PER_SEQUENCE = 16, 4  # 64 positions per sequence
PADDING = 3  # rows past the last sequence's tokens

# name: (new tokens per sequence, kv_lengths once they are cached)
MIXES = {
    "all-decode": ([1, 1, 1, 1], [1, 17, 40, 64]),
    "all-prefill": ([5, 16, 33, 64], [5, 16, 33, 64]),
    "mixed-with-empty": ([1, 0, 20, 7, 1], [30, 12, 37, 7, 64]),
    "chunk-across-pages": ([40, 1], [56, 2]),
}


@dataclasses.dataclass
class Case:
    """One call's inputs and what the float64 reference expects of it."""

    q: jax.Array  # [tokens, q_heads, head_dim]
    k: jax.Array  # [tokens, kv_heads, head_dim]
    v: jax.Array
    k_pages: jax.Array  # [num_pages, kv_heads, page_size, head_dim]
    v_pages: jax.Array
    table: np.ndarray  # [seqs, pages_per_sequence]
    starts: np.ndarray  # [seqs + 1]
    lengths: np.ndarray  # [seqs]
    written: tuple[np.ndarray, np.ndarray]  # the pools once the new tokens are in (float32)

    def expected(self, **options) -> np.ndarray:
        k, v = (reference.gather_pages(np.nan_to_num(x), self.table) for x in self.written)
        head_dim = self.q.shape[-1]
        return reference.ragged(self.q, k, v, self.starts, self.lengths,
                                sm_scale=1 / math.sqrt(head_dim), **options)  # fmt: skip

    def call(self, backend: str, **options) -> tuple[jax.Array, pf.DecodeCache]:
        return pf.ragged_attention(self.q, self.k, self.v, self.k_pages, self.v_pages,
                                   self.table, self.starts, self.lengths, backend=backend,
                                   **options)  # fmt: skip


def _case(mix: str, dtype: str = "float32", q_heads: int = 4, kv_heads: int = 4,
          head_dim: int = 128, seed: int = 0) -> Case:  # fmt: skip
    """The inputs of ``MIXES[mix]`` (module doc)."""
    news, lengths = (np.asarray(x, np.int32) for x in MIXES[mix])
    seqs, tokens = len(news), int(news.sum()) + PADDING
    rng = np.random.default_rng(seed)
    num_pages = 2 * seqs * PAGES_PER_SEQUENCE  # half the pool is never handed out
    table = rng.permutation(num_pages)[: seqs * PAGES_PER_SEQUENCE].reshape(seqs, -1)
    starts = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    shape = (num_pages, kv_heads, PAGE_SIZE, head_dim)
    cached = np.zeros(shape[:3], bool)  # positions held before the call
    for s in range(seqs):
        for p in range(lengths[s] - news[s]):
            cached[table[s, p // PAGE_SIZE], :, p % PAGE_SIZE] = True
    q = inputs.normal(seed, (tokens, q_heads, head_dim), dtype)
    k, v = (inputs.normal(seed + s, (tokens, kv_heads, head_dim), dtype) for s in (1, 2))
    pools, written = [], []
    for s, new in ((3, k), (4, v)):
        pool = np.array(inputs.normal(seed + s, shape, dtype), np.float32)
        pool[~cached] = np.nan
        pools.append(jnp.asarray(pool, inputs.DTYPES[dtype]))
        pool = np.array(pools[-1], np.float32)
        for s_, (first, end) in enumerate(itertools.pairwise(starts)):
            for row in range(first, end):
                p = lengths[s_] - (end - row)
                pool[table[s_, p // PAGE_SIZE], :, p % PAGE_SIZE] = np.asarray(new[row], np.float32)
        written.append(pool)
    return Case(q, k, v, *pools, table.astype(np.int32), starts, lengths, tuple(written))


def _assert_padding_zero(out: jax.Array, case: Case) -> None:
    assert (np.asarray(out[case.starts[-1] :], np.float32) == 0).all(), "padding rows are zeros"


def _assert_written(cache: pf.DecodeCache, case: Case) -> None:
    """The returned pools hold the new tokens at their positions and are otherwise unchanged
    (NaN where they were NaN)."""
    for name, got, want in (("k", cache.k, case.written[0]), ("v", cache.v, case.written[1])):
        np.testing.assert_array_equal(np.asarray(got, np.float32), want, err_msg=name)
    np.testing.assert_array_equal(np.asarray(cache.page_table), case.table)


@pytest.mark.parametrize(
    ("mix", "dtype"),
    [(mix, "bfloat16") for mix in MIXES] + [("mixed-with-empty", "float32")],
)
def test_ragged_mixes(backend, mix: str, dtype: str) -> None:
    case = _case(mix, dtype)
    out, cache = case.call(backend.name)
    assert out.dtype == case.q.dtype
    assert_close(out, case.expected(), FORWARD_TOLERANCE[dtype])
    _assert_padding_zero(out, case)
    _assert_written(cache, case)


@pytest.mark.requires("gqa")
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(2, 128), (1, 64)], ids=["gqa4", "mqa-d64"])
def test_ragged_grouped_heads(backend, kv_heads: int, head_dim: int) -> None:
    case = _case("mixed-with-empty", "bfloat16", q_heads=8, kv_heads=kv_heads, head_dim=head_dim)
    out, cache = case.call(backend.name)
    assert_close(out, case.expected(), FORWARD_TOLERANCE["bfloat16"])
    _assert_padding_zero(out, case)
    _assert_written(cache, case)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"softcap": 2.0}, id="softcap", marks=pytest.mark.requires("softcap")),
        pytest.param({"sliding_window": 9}, id="window",
                     marks=pytest.mark.requires("sliding_window")),
        pytest.param({"sinks": True}, id="sinks", marks=pytest.mark.requires("sinks")),
    ],
)  # fmt: skip
def test_ragged_options(backend, options: dict) -> None:
    case = _case("mixed-with-empty", seed=1)
    if options.get("sinks"):
        options = {"sinks": inputs.normal(9, (case.q.shape[1],), scale=2.0)}
    out, _ = case.call(backend.name, **options)
    expected = dict(options)
    if "sliding_window" in expected:
        expected["window"] = expected.pop("sliding_window")
    assert_close(out, case.expected(**expected), FORWARD_TOLERANCE["float32"])
    _assert_padding_zero(out, case)


def test_ragged_under_jit_with_traced_layout_and_donated_cache(backend) -> None:
    """The serving step's use: the layout traced, the pools donated and written in place."""
    case = _case("mixed-with-empty", "bfloat16")

    @jax.jit
    def step(k_pages, v_pages, table, starts, lengths):
        return pf.ragged_attention(case.q, case.k, case.v, k_pages, v_pages, table, starts,
                                   lengths, backend=backend.name)  # fmt: skip

    step = jax.jit(step, donate_argnums=(0, 1))
    out, cache = step(case.k_pages, case.v_pages, case.table, case.starts, case.lengths)
    assert_close(out, case.expected(), FORWARD_TOLERANCE["bfloat16"])
    _assert_written(cache, case)


@pytest.mark.requires("decode", "paged_cache")
def test_ragged_decode_tokens_match_decode(backend) -> None:
    """A batch of decode tokens gives what ``pf.decode`` gives on the cache it wrote."""
    case = _case("all-decode")
    out, cache = case.call(backend.name)
    decoded = pf.decode(case.q[:4], cache.k, cache.v, case.lengths, page_table=cache.page_table,
                        backend=backend.name)  # fmt: skip
    assert_close(out[:4], np.asarray(decoded, np.float64), FORWARD_TOLERANCE["float32"])


@pytest.mark.requires("int8_cache", "gqa")
def test_ragged_int8_cache(backend) -> None:
    """An int8 pool: the new tokens are quantized as they are written (a scale per row), and
    the output is attention over what the cache then holds (its dequantized values)."""
    case = _case("mixed-with-empty", q_heads=8, kv_heads=2)
    k8, k_scales = pf.quantize_int8(jnp.nan_to_num(case.k_pages))
    v8, v_scales = pf.quantize_int8(jnp.nan_to_num(case.v_pages))
    out, cache = pf.ragged_attention(
        case.q.astype(jnp.bfloat16), case.k.astype(jnp.bfloat16), case.v.astype(jnp.bfloat16),
        k8, v8, case.table, case.starts, case.lengths, k_scales=k_scales, v_scales=v_scales,
        backend=backend.name,
    )  # fmt: skip
    held = [reference.dequantize(x, s) for x, s in ((cache.k, cache.k_scales),
                                                   (cache.v, cache.v_scales))]  # fmt: skip
    for got, want in zip(held, case.written, strict=True):  # quantizing costs <= 1/254 of a row
        written = ~np.isnan(want)
        bound = np.abs(np.nan_to_num(want)).max(-1, keepdims=True) / 127
        assert (np.abs(got - np.nan_to_num(want)) <= bound + 1e-6)[written].all()
    expected = dataclasses.replace(case, q=case.q.astype(jnp.bfloat16), written=tuple(held))
    assert_close(out, expected.expected(), FORWARD_TOLERANCE["bfloat16"])
    _assert_padding_zero(out, case)


@pytest.mark.requires("packed_cache", "gqa")
@pytest.mark.parametrize("mix", ["all-decode", "mixed-with-empty", "chunk-across-pages"])
def test_ragged_packed_cache_under_jit_donated(backend, mix: str) -> None:
    """A packed bfloat16 pool (keys and values in one uint32 array, ``v_cache=None``), donated
    and written in place under jit, as the serving engine keeps it: the output, and the pool
    unpacked holds the new tokens at their positions and is otherwise unchanged."""
    case = _case(mix, "bfloat16", q_heads=8, kv_heads=2)

    def step(words, table, starts, lengths):
        return pf.ragged_attention(case.q, case.k, case.v, words, None, table, starts, lengths,
                                   backend=backend.name)  # fmt: skip

    step = jax.jit(step, donate_argnums=0)
    words = pf.pack_kv(case.k_pages, case.v_pages)
    out, cache = step(words, case.table, case.starts, case.lengths)
    assert cache.v is None and cache.k.dtype == jnp.uint32
    assert_close(out, case.expected(), FORWARD_TOLERANCE["bfloat16"])
    _assert_padding_zero(out, case)
    _assert_written(cache.unpacked(jnp.bfloat16), case)


@pytest.mark.requires("decode", "paged_cache", "packed_cache")
def test_ragged_decode_tokens_match_decode_of_a_packed_cache(backend) -> None:
    """A batch of decode tokens on a packed pool gives what ``pf.decode`` gives on the packed
    pool it wrote."""
    case = _case("all-decode", "bfloat16")
    out, cache = pf.ragged_attention(
        case.q, case.k, case.v, pf.pack_kv(case.k_pages, case.v_pages), None, case.table,
        case.starts, case.lengths, backend=backend.name,
    )  # fmt: skip
    decoded = pf.decode(case.q[:4], cache.k, None, case.lengths, page_table=cache.page_table,
                        backend=backend.name)  # fmt: skip
    assert_close(out[:4], np.asarray(decoded, np.float64), FORWARD_TOLERANCE["bfloat16"])
