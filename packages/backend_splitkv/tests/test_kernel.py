"""The decode kernel with several blocks and splits per sequence, in the interpreter off TPU:
ragged lengths (0, inside a block, on a block edge, the whole cache), stale NaN slots, GQA."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close
from pallas_flash_splitkv import DecodeBlocks, paged_kernel, split_kv_decode

BLOCKS = [DecodeBlocks(128, 1), DecodeBlocks(128, 3), DecodeBlocks(256, 2), DecodeBlocks()]


@pytest.mark.parametrize("blocks", BLOCKS, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_reference_with_stale_nan_slots(blocks: DecodeBlocks, dtype: str) -> None:
    batch, q_heads, kv_heads, max_len, head_dim = 5, 8, 2, 1000, 64
    lengths = np.array([0, 1, 128, 999, 1000], np.int32)
    q = inputs.normal(0, (batch, q_heads, head_dim), dtype)
    k = np.array(inputs.normal(1, (batch, kv_heads, max_len, head_dim), dtype), np.float32)
    v = np.array(inputs.normal(2, (batch, kv_heads, max_len, head_dim), dtype), np.float32)
    scale = 1 / math.sqrt(head_dim)
    expected = reference.decode(q, k, v, lengths, sm_scale=scale, softcap=2.0)
    for b, length in enumerate(lengths):
        k[b, :, length:] = np.nan
        v[b, :, length:] = np.nan
    out = split_kv_decode(
        q,
        pf.DecodeCache(jnp.asarray(k, q.dtype), jnp.asarray(v, q.dtype)),
        jnp.asarray(lengths),
        spec=pf.DecodeSpec(sm_scale=scale, softcap=2.0),
        blocks=blocks,
        mesh=None,
    )
    assert out.dtype == q.dtype
    assert_close(out, expected, FORWARD_TOLERANCE[dtype])
    assert (np.asarray(out[0], np.float32) == 0).all()


@pytest.mark.parametrize("blocks", [DecodeBlocks(128, 3), DecodeBlocks(256, 2)], ids=str)
def test_traced_lengths_out_of_range_are_clipped(blocks: DecodeBlocks) -> None:
    """Under jit lengths cannot be checked: past ``max_len`` counts as ``max_len`` (a partial
    last block is not read as whole, no index map points past the cache), below 0 as 0."""
    batch, q_heads, kv_heads, max_len, head_dim = 4, 4, 2, 1000, 64
    lengths = np.array([1001, 1100, 2**31 - 1, -3], np.int32)
    q = inputs.normal(0, (batch, q_heads, head_dim))
    k = inputs.normal(1, (batch, kv_heads, max_len, head_dim))
    v = inputs.normal(2, (batch, kv_heads, max_len, head_dim))
    scale = 1 / math.sqrt(head_dim)
    out = jax.jit(
        lambda lengths: split_kv_decode(
            q,
            pf.DecodeCache(k, v),
            lengths,
            spec=pf.DecodeSpec(sm_scale=scale),
            blocks=blocks,
            mesh=None,
        )
    )(lengths)
    clipped = np.clip(lengths, 0, max_len)
    assert_close(
        out, reference.decode(q, k, v, clipped, sm_scale=scale), FORWARD_TOLERANCE["float32"]
    )
    xla = jax.jit(lambda lengths: pf.decode(q, k, v, lengths, backend="xla"))(lengths)
    assert_close(out, xla, FORWARD_TOLERANCE["float32"])
    assert (np.asarray(out[3]) == 0).all()


@pytest.mark.parametrize(
    ("per_step", "dtype"),
    [
        (3, "bfloat16"),
        (None, "bfloat16"),
        (3, "int8"),
        (None, "int8"),
        (3, "packed"),
        (1, "packed"),
    ],
    ids=[
        "3-pages-bf16",
        "auto-bf16",
        "3-pages-int8",
        "auto-int8",
        "3-pages-packed",
        "block-specs-packed",
    ],
)
def test_paged_steps_of_several_pages_prefetch_across_sequences(per_step, dtype: str) -> None:
    """Pages of 128, 3 per step over tables of 7 (a last step of one page): sequences that
    are empty first, between others (a step starts the copies of the next non-empty one) and
    last, end inside a page, on a step's edge, or fill the table; pages shuffled; NaN in
    every slot past a length and in every page nobody uses. A packed bfloat16 cache (its
    keys and values in one uint32 pool) also by the block-spec kernel (a page a step)."""
    batch, q_heads, kv_heads, page, head_dim, per_sequence = 7, 4, 2, 128, 64, 7
    lengths = np.array([0, 5, 3 * page, 0, 7 * page, 3 * page + 1, 0], np.int32)
    rng = np.random.default_rng(0)
    num_pages = batch * per_sequence + 3
    table = rng.permutation(num_pages)[: batch * per_sequence].reshape(batch, per_sequence)
    pools = [np.array(inputs.normal(s, (num_pages, kv_heads, page, head_dim))) for s in (1, 2)]
    valid = np.zeros((num_pages, kv_heads, page), bool)
    for b, n in enumerate(lengths):
        for j in range(-(-n // page)):
            valid[table[b, j], :, : min(page, n - j * page)] = True
    q = inputs.normal(0, (batch, q_heads, head_dim), "bfloat16")
    if dtype == "int8":
        (k8, ks), (v8, vs) = (pf.quantize_int8(jnp.asarray(x)) for x in pools)
        scales = [jnp.where(valid, s, jnp.nan) for s in (ks, vs)]
        contiguous = [reference.dequantize(x, np.asarray(s)) for x, s in ((k8, ks), (v8, vs))]
        cache = pf.DecodeCache(k8, v8, jnp.asarray(table, jnp.int32), *scales)
    else:
        contiguous = pools
        k, v = (jnp.asarray(np.where(valid[..., None], x, np.nan), jnp.bfloat16) for x in pools)
        cache = pf.DecodeCache(k, v, jnp.asarray(table, jnp.int32))
        if dtype == "packed":
            cache = cache._replace(k=pf.pack_kv(k, v), v=None)
    k_all, v_all = (reference.gather_pages(np.asarray(x, np.float32), table) for x in contiguous)
    scale = 1 / math.sqrt(head_dim)
    expected = reference.decode(q, k_all, v_all, lengths, sm_scale=scale)
    out = split_kv_decode(
        q, cache, jnp.asarray(lengths), spec=pf.DecodeSpec(sm_scale=scale),
        blocks=DecodeBlocks(pages_per_step=per_step), mesh=None,
    )  # fmt: skip
    assert_close(out, expected, FORWARD_TOLERANCE["bfloat16"])
    assert (np.asarray(out, np.float32)[[0, 3, 6]] == 0).all()


@pytest.mark.parametrize("per_step", [3, 2], ids=["chunks", "pages"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_contiguous_cache_read_in_pages_copies_only_what_lengths_reach(
    dtype: str, per_step: int
) -> None:
    """A contiguous cache of 7 pages of 128 positions, 3 per step (a last step of one page),
    read by the page-copying kernel: sequences empty first, between others and last, ending
    inside a page, on a step's edge or filling the cache, with NaN in every slot past a
    length (in pages never copied and in the rest of a copied one). A step copies its pages
    in chunks of 2 and 1 (`binary_chunks`): steps holding 1, 2 and 3 pages; steps of 2 pages
    copy by the page."""
    batch, q_heads, kv_heads, head_dim = 8, 4, 2, 64
    max_len = 7 * paged_kernel.CONTIGUOUS_PAGE
    lengths = np.array([0, 5, 384, 0, max_len, 385, 0, 600], np.int32)
    blocks = DecodeBlocks(block_kv=per_step * paged_kernel.CONTIGUOUS_PAGE)
    valid = np.arange(max_len)[None, None, :] < lengths[:, None, None]
    shape = (batch, kv_heads, max_len, head_dim)
    k, v = (np.array(inputs.normal(s, shape)) for s in (1, 2))
    q = inputs.normal(0, (batch, q_heads, head_dim), dtype)
    stale = [jnp.asarray(np.where(valid[..., None], x, np.nan), dtype) for x in (k, v)]
    cache = pf.DecodeCache(*stale)
    assert paged_kernel.contiguous_pages_per_step(blocks, cache.k) == per_step
    scale = 1 / math.sqrt(head_dim)
    expected = reference.decode(q, np.asarray(k, np.float32), np.asarray(v, np.float32),
                                lengths, sm_scale=scale)  # fmt: skip
    out = split_kv_decode(
        q, cache, jnp.asarray(lengths), spec=pf.DecodeSpec(sm_scale=scale), blocks=blocks,
        mesh=None,
    )  # fmt: skip
    assert_close(out, expected, FORWARD_TOLERANCE[dtype])
    assert (np.asarray(out, np.float32)[[0, 3, 6]] == 0).all()


def test_a_step_copies_one_chunk_per_bit_of_its_page_count() -> None:
    assert paged_kernel.binary_chunks(8) == [8, 4, 2, 1]
    assert paged_kernel.binary_chunks(12) == [8, 4, 2, 1]
    assert paged_kernel.binary_chunks(3) == [2, 1]
    assert paged_kernel.binary_chunks(1) == [1]


def test_contiguous_cache_read_by_block_specs_where_pages_do_not_pay() -> None:
    """The block-spec kernel keeps a contiguous cache that is not a multiple of 128
    positions, a block of one page, several splits, and an int8 cache."""
    k = jnp.zeros((2, 2, 1024, 64), jnp.bfloat16)
    assert paged_kernel.contiguous_pages_per_step(DecodeBlocks(), k) == 8
    assert paged_kernel.contiguous_pages_per_step(DecodeBlocks(), k[:, :, :1000]) is None
    assert paged_kernel.contiguous_pages_per_step(DecodeBlocks(128), k) is None
    assert paged_kernel.contiguous_pages_per_step(DecodeBlocks(256, 2), k) is None
    assert paged_kernel.contiguous_pages_per_step(DecodeBlocks(), k.astype(jnp.int8)) is None


def test_paged_batch_with_no_token_copies_nothing() -> None:
    """Every sequence empty: no step holds a position, so none starts or waits for a copy
    (a wait nobody started would never end), and the output is 0."""
    batch, q_heads, kv_heads, page, head_dim, per_sequence = 3, 4, 2, 128, 64, 4
    pool = jnp.full((batch * per_sequence, kv_heads, page, head_dim), jnp.nan, jnp.bfloat16)
    table = jnp.arange(batch * per_sequence, dtype=jnp.int32).reshape(batch, per_sequence)
    out = split_kv_decode(
        inputs.normal(0, (batch, q_heads, head_dim), "bfloat16"),
        pf.DecodeCache(pool, pool, table),
        jnp.zeros((batch,), jnp.int32),
        spec=pf.DecodeSpec(sm_scale=0.125),
        blocks=DecodeBlocks(pages_per_step=2),
        mesh=None,
    )
    assert (np.asarray(out, np.float32) == 0).all()


def test_first_non_empty_points_each_sequence_at_the_next_one_holding_a_token() -> None:
    lengths = jnp.array([0, 5, 0, 0, 9, 2**31 - 1, -4, 0], jnp.int32)
    got = jax.jit(paged_kernel.first_non_empty, static_argnums=1)(lengths, 100)
    assert np.asarray(got).tolist() == [1, 1, 4, 4, 4, 5, 8, 8, 8]
