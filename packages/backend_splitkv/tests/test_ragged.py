"""The ragged paged attention kernel (`ragged_attention`, `ragged_kernel`), in TPU interpret
mode, against the xla backend's dense reference, the cache it writes the xla backend's (a
packed cache's written by the kernel itself, the others by core): decode tokens,
prefill chunks and both mixed, empty sequences, padding rows, chunks crossing pages and kv
blocks, GQA, softcap, sliding window, sinks, int8, bfloat16 and packed bfloat16 caches, with
blocks small enough that a
sequence spans several query and kv blocks (the conformance suite runs the default blocks, MQA
and MHA)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close
from pallas_flash_splitkv import RaggedBlocks, SplitKvBackend, ragged_attention, ragged_blocks
from pallas_flash_splitkv.ragged_blocks import kernel_calls, schedule

HEAD_DIM, PAGE_SIZE, PAGES_PER_SEQUENCE = 128, 8, 6
SMALL = SplitKvBackend(ragged_blocks=RaggedBlocks(block_q=8, pages_per_block=2))
"""Blocks of 16 positions (2 pages) and 8 tokens: a short sequence spans several of each."""


def _call(
    new: list[int],
    lengths: list[int],
    *,
    tokens: int | None = None,
    q_heads: int = 4,
    kv_heads: int = 2,
    dtype: jnp.dtype = jnp.float32,
    int8: bool = False,
    packed: bool = False,
    sinks: bool = False,
    stale_nan: bool = False,
    unused_pages: int | None = None,
    backend: SplitKvBackend | None = SMALL,
    **options: object,
) -> tuple[jax.Array, jax.Array, int]:
    """(kernel output, reference output, valid rows) of one batch: sequence ``s`` has
    ``new[s]`` new tokens and ``lengths[s]`` positions; its pages are spread over the pool.
    ``backend=None``: through ``pf.ragged_attention(backend="splitkv")``; ``unused_pages``:
    the table's entries past each sequence's length (which may hold anything); ``packed``:
    the cache's keys and values packed in one array (``dtype`` 16-bit, `pf.pack_kv`)."""
    seqs, valid = len(new), sum(new)
    tokens = valid if tokens is None else tokens
    num_pages = seqs * PAGES_PER_SEQUENCE + 3
    # numpy's generator: jax.random would compile a program per shape, seconds a test
    rng = np.random.default_rng(sum(new) + 7 * sum(lengths))
    pool = (num_pages, kv_heads, PAGE_SIZE, HEAD_DIM)
    k_cache = jnp.asarray(rng.standard_normal(pool, np.float32))
    v_cache = jnp.asarray(rng.standard_normal(pool, np.float32))
    table = rng.permutation(num_pages)[: seqs * PAGES_PER_SEQUENCE]
    table = jnp.asarray(table.reshape(seqs, PAGES_PER_SEQUENCE), jnp.int32)
    if unused_pages is not None:
        column = jnp.arange(PAGES_PER_SEQUENCE)[None, :]
        used = column < -(-jnp.asarray(lengths)[:, None] // PAGE_SIZE)
        table = jnp.where(used, table, unused_pages)
    if stale_nan:  # every slot past a sequence's length (and unused pages) holds NaN
        position = np.arange(PAGES_PER_SEQUENCE * PAGE_SIZE)
        stale = np.ones(pool[0] * PAGE_SIZE, bool)
        flat = np.asarray(table)[:, position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE
        stale[flat[position[None] < np.asarray(lengths)[:, None]]] = False
        mask = jnp.asarray(stale.reshape(pool[0], 1, PAGE_SIZE, 1))
        k_cache, v_cache = (jnp.where(mask, jnp.nan, x) for x in (k_cache, v_cache))
    scales = {}
    if int8:
        (k_cache, k_scales), (v_cache, v_scales) = map(pf.quantize_int8, (k_cache, v_cache))
        scales = {"k_scales": k_scales, "v_scales": v_scales}
    else:
        k_cache, v_cache = k_cache.astype(dtype), v_cache.astype(dtype)
    if packed:
        k_cache, v_cache = pf.pack_kv(k_cache, v_cache), None
    q, k, v = (
        jnp.asarray(rng.standard_normal((tokens, heads, HEAD_DIM), np.float32), dtype)
        for heads in (q_heads, kv_heads, kv_heads)
    )
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(new)]), jnp.int32)
    kv_lengths = jnp.asarray(lengths, jnp.int32)
    if sinks:
        options["sinks"] = jnp.asarray(rng.standard_normal(q_heads, np.float32))
    args = (q, k, v, k_cache, v_cache, table, starts, kv_lengths)
    expected, cache = pf.ragged_attention(*args, backend="xla", **scales, **options)
    if backend is None:
        actual, written = pf.ragged_attention(*args, backend="splitkv", **scales, **options)
        for mine, theirs in zip(written, cache, strict=True):
            assert mine is None or (mine == theirs).all()
        return actual, expected, valid
    spec = pf.RaggedSpec(
        sm_scale=HEAD_DIM**-0.5,
        softcap=options.get("softcap"),
        window=options.get("sliding_window"),
    )
    unwritten = pf.DecodeCache(k_cache, v_cache, table, *scales.values())
    actual, written = backend.ragged_attention_and_write(
        q, k, v, unwritten, starts, kv_lengths, spec, sinks=options.get("sinks")
    )
    for mine, theirs in zip(written, cache, strict=True):
        same = mine is None or jnp.array_equal(mine, theirs, equal_nan=True)  # stale NaN
        assert same, "the written cache must be xla's"
    return actual, expected, valid


def _check(actual, expected, valid: int, tolerance: float) -> None:
    assert actual.dtype == expected.dtype
    assert_close(actual[:valid], np.asarray(expected[:valid], np.float64), tolerance)
    assert not np.asarray(actual[valid:], np.float32).any(), "padding rows must be zeros"


F32 = FORWARD_TOLERANCE["float32"]


@pytest.mark.parametrize(
    ("new", "lengths"),
    [
        ([1, 1, 1, 1], [1, 9, 17, 48]),  # all decode: first position, page and block edges
        ([5, 12, 20], [5, 30, 47]),  # all prefill: chunks across pages, blocks, query blocks
        ([1, 7, 1, 16], [33, 7, 16, 40]),  # mixed decode and prefill
    ],
    ids=["decode", "prefill", "mixed"],
)
def test_matches_the_dense_reference(new: list[int], lengths: list[int]) -> None:
    _check(*_call(new, lengths), F32)


def test_empty_sequences_and_padding_rows_give_zeros() -> None:
    actual, expected, valid = _call([0, 3, 0, 1, 0], [4, 11, 0, 25, 9], tokens=12)
    _check(actual, expected, valid, F32)


# the stale rows are zeroed per page (f32: pages of whole tiles), per block (bf16: shorter pages)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_stale_nan_slots_are_never_seen(dtype: jnp.dtype) -> None:
    actual, expected, valid = _call([1, 6, 2], [13, 19, 40], dtype=dtype, stale_nan=True)
    _check(actual, expected, valid, FORWARD_TOLERANCE[jnp.dtype(dtype).name])


@pytest.mark.parametrize("unused", [-1, 10**6])
def test_table_entries_past_the_lengths_are_never_read(unused: int) -> None:
    _check(*_call([2, 1], [9, 17], unused_pages=unused, int8=True), 1e-4)


@pytest.mark.parametrize(
    "options",
    [{"softcap": 2.0}, {"sliding_window": 5}, {"sinks": True}],
    ids=["softcap", "window5", "sinks"],
)
def test_features(options: dict) -> None:
    _check(*_call([1, 9, 3], [30, 26, 45], q_heads=8, kv_heads=2, **options), F32)


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
def test_a_window_s_blocks_every_row_sees_are_folded_unmasked(int8: bool) -> None:
    """A window of 30 over blocks of 16: the decode at 47 sees 17..47 (block 1 masked, 2
    whole), the chunk at 31..39 sees 1..39, all its rows 9..31 (block 0 masked, 1 whole, 2
    masked), the chunk at 42..44 sees 12..44 (blocks 0 to 2 masked): as the dense reference."""
    got = _call([1, 9, 3], [48, 40, 45], q_heads=8, kv_heads=2, sliding_window=30, int8=int8)
    _check(*got, 1e-4 if int8 else F32)


def test_a_window_s_default_blocks_through_the_api() -> None:
    """The default blocks under a window of 30: a quarter of the 31 positions a token sees
    rounded up is 8, raised to `ragged_blocks.WINDOW_BLOCK_POSITIONS` (the whole sequence in
    one block here)."""
    actual, expected, valid = _call([1, 9, 3], [48, 40, 45], sliding_window=30, backend=None)
    _check(actual, expected, valid, F32)


def test_kv_heads_a_grid_step_in_groups() -> None:
    """Four kv heads, one a grid step (so a head group's last item starts the next group's
    first block) and two, int8 and sinks: the same as the dense reference."""
    for per_step in (1, 2):
        blocks = RaggedBlocks(block_q=8, pages_per_block=2, kv_heads_per_step=per_step)
        got = _call([1, 9, 2], [17, 25, 40], q_heads=8, kv_heads=4, int8=True, sinks=True,
                    backend=SplitKvBackend(ragged_blocks=blocks))  # fmt: skip
        _check(*got, 1e-4)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"int8": True, "sinks": True},
        {"sliding_window": 12},
        {"dtype": jnp.bfloat16},
        {"dtype": jnp.bfloat16, "packed": True},
    ],
    ids=["float32", "int8-sinks", "window", "bfloat16", "packed"],
)
def test_items_of_several_decoding_sequences(options: dict) -> None:
    """The decode call's items take 4 decoding sequences each (2 query heads a kv head): 7 of
    them in two items, the second partly used, of 1 to 3 kv blocks each (an item runs its
    longest entry's), beside a prefill chunk, one kv head a grid step (an item's last block
    starts the next head group's first): the same as the dense reference."""
    blocks = RaggedBlocks(block_q=8, pages_per_block=2, kv_heads_per_step=1)
    new, lengths = [1, 1, 9, 1, 1, 1, 1, 1], [3, 40, 25, 17, 48, 16, 33, 9]
    got = _call(new, lengths, backend=SplitKvBackend(ragged_blocks=blocks), **options)
    _check(*got, FORWARD_TOLERANCE["bfloat16"] if "dtype" in options else 1e-4)


def test_decoding_sequences_kv_blocks_of_their_own_size() -> None:
    """The decode call's kv blocks of 3 pages beside the other call's 2 (an int8 cache's
    scales laid out in whole blocks of both), against the dense reference; and the default:
    `ragged_blocks.DECODE_KV_BLOCK_POSITIONS` for the decode call and
    `ragged_blocks.KV_BLOCK_POSITIONS` for the other unless pages are given, fewer at several
    kv heads a grid step."""
    blocks = RaggedBlocks(block_q=8, pages_per_block=2, decode_pages_per_block=3)
    got = _call([1, 9, 1, 2], [17, 25, 48, 40], int8=True,
                backend=SplitKvBackend(ragged_blocks=blocks))  # fmt: skip
    _check(*got, 1e-4)
    decode = ragged_attention.DECODE_KERNEL_NAME
    assert blocks.pages_for(PAGE_SIZE, PAGES_PER_SEQUENCE, decode) == 3
    assert blocks.pages_for(PAGE_SIZE, PAGES_PER_SEQUENCE) == 2
    assert SMALL.ragged_blocks.pages_for(PAGE_SIZE, PAGES_PER_SEQUENCE, decode) == 2
    default = RaggedBlocks()
    assert default.pages_for(128, 64, decode) == ragged_blocks.DECODE_KV_BLOCK_POSITIONS // 128
    most = ragged_blocks.DECODE_KV_BLOCK_HEAD_POSITIONS  # over a grid step's kv heads
    assert default.pages_for(128, 64, decode, heads=8) == most // 8 // 128
    assert default.pages_for(128, 64) == ragged_blocks.KV_BLOCK_POSITIONS // 128
    prefill_most = ragged_blocks.KV_BLOCK_HEAD_POSITIONS  # fewer at 8 kv heads a step
    assert default.pages_for(128, 64, heads=8) == prefill_most // 8 // 128
    assert default.pages_for(128, 3, decode) == 3  # at most a sequence's pages
    # a window: a quarter of the positions a token sees, at least WINDOW_BLOCK_POSITIONS
    fewest = ragged_blocks.WINDOW_BLOCK_POSITIONS
    assert default.pages_for(16, 512, decode, window=1023) == fewest // 16
    assert default.pages_for(128, 64, decode, window=8191) == 2048 // 128
    assert default.pages_for(128, 64, decode, window=4095) == 1024 // 128
    assert default.pages_for(128, 64, window=10**6) == ragged_blocks.KV_BLOCK_POSITIONS // 128
    assert default.pages_for(16, 512, decode, window=1) == default.pages_for(16, 64, window=0)
    assert default.pages_for(16, 64, window=0) == fewest // 16
    assert default.pages_for(256, 64, decode, window=30) == fewest // 256
    with pytest.raises(ValueError, match="decode_pages_per_block"):
        RaggedBlocks(decode_pages_per_block=0)


def test_int8_cache() -> None:
    actual, expected, valid = _call([1, 10, 4], [17, 25, 44], int8=True, sinks=True)
    _check(actual, expected, valid, 1e-4)


def test_bfloat16_with_window_and_softcap() -> None:
    actual, expected, valid = _call(
        [1, 13, 2], [40, 13, 20], dtype=jnp.bfloat16, sliding_window=9, softcap=5.0
    )
    _check(actual, expected, valid, FORWARD_TOLERANCE["bfloat16"])


@pytest.mark.parametrize(
    ("new", "lengths"),
    [
        ([1, 1, 1, 1], [1, 9, 17, 48]),
        ([1, 7, 1, 16], [33, 7, 16, 40]),
        ([5, 12, 20], [5, 30, 47]),
    ],
    ids=["decode", "mixed", "prefill"],
)
def test_a_packed_cache_with_stale_nan_window_softcap_and_sinks(new, lengths) -> None:
    """A packed bfloat16 cache (one array of keys and values, `pallas_flash.kv_packing`)
    whose stale slots hold NaN in both halves, its new tokens written by the kernel (chunks
    over several items, a window starting inside a page): the same as the dense reference,
    GQA, and the pool xla writes."""
    got = _call(new, lengths, q_heads=8, dtype=jnp.bfloat16, packed=True, stale_nan=True,
                sinks=True, sliding_window=20, softcap=5.0)  # fmt: skip
    _check(*got, FORWARD_TOLERANCE["bfloat16"])


def test_a_packed_cache_through_the_api_writes_what_xla_writes() -> None:
    """splitkv's kernel writes the new tokens into the packed pool through the API: the
    written pool and the output are the xla backend's."""
    got = _call([3, 1, 0], [20, 44, 0], tokens=6, dtype=jnp.bfloat16, packed=True, backend=None)
    _check(*got, FORWARD_TOLERANCE["bfloat16"])


def test_the_kernel_writes_only_a_packed_cache() -> None:
    """A float cache's rows are not 32-bit: the kernel does not write it (core does)."""
    pool = jnp.zeros((4, 1, PAGE_SIZE, HEAD_DIM), jnp.bfloat16)
    new = jnp.zeros((1, 1, HEAD_DIM), jnp.bfloat16)
    cache = pf.DecodeCache(pool, pool, jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="cache: expected a packed cache"):
        ragged_attention.ragged_attention_and_write(
            new, new, new, cache, jnp.asarray([0, 1]), jnp.asarray([3]),
            spec=pf.RaggedSpec(sm_scale=1.0), blocks=RaggedBlocks(),
        )  # fmt: skip


def test_a_packed_cache_written_before_the_call_is_read_exactly() -> None:
    """``ragged_attention`` of a packed cache core has already written (the backend API's
    read-only call): every position copied from its page, the new ones too, with a window
    starting inside a page; the output is the one the kernel gives when it writes them."""
    rng = np.random.default_rng(3)
    pool = (14, 2, PAGE_SIZE, HEAD_DIM)
    words = pf.pack_kv(*(jnp.asarray(rng.standard_normal(pool), jnp.bfloat16) for _ in "kv"))
    table = jnp.asarray(rng.permutation(14)[:12].reshape(2, 6), jnp.int32)
    q, k, v = (jnp.asarray(rng.standard_normal((8, heads, HEAD_DIM)), jnp.bfloat16)
               for heads in (4, 2, 2))  # fmt: skip
    starts, lengths = jnp.asarray([0, 1, 8], jnp.int32), jnp.asarray([30, 21], jnp.int32)
    spec = pf.RaggedSpec(sm_scale=HEAD_DIM**-0.5, window=11)
    unwritten = pf.DecodeCache(words, None, table)
    writing, cache = SMALL.ragged_attention_and_write(q, k, v, unwritten, starts, lengths, spec)
    reading = SMALL.ragged_attention(q, cache, starts, lengths, spec)
    np.testing.assert_array_equal(np.asarray(reading, np.float32), np.asarray(writing, np.float32))


@pytest.mark.parametrize("entry", [-1, 10**6])
def test_a_packed_token_whose_page_is_out_of_the_pool_is_written_nowhere(entry: int) -> None:
    """A decode token and a chunk's last tokens whose table entries lie outside the pool (a
    caller's bug the API cannot check when traced): the kernel writes them nowhere, as core
    writes for the xla backend, and the rest of the pool as xla writes it."""
    rng = np.random.default_rng(5)
    pool = (12, 1, PAGE_SIZE, HEAD_DIM)
    words = pf.pack_kv(*(jnp.asarray(rng.standard_normal(pool), jnp.bfloat16) for _ in "kv"))
    table = jnp.asarray([[0, 1, 2, entry, 4, 5], [6, 7, entry, 9, 10, 11]], jnp.int32)
    # a decode token at 24 (page entry 3), a chunk at 14..19 (pages 1 and 2, entry 2)
    q, k, v = (jnp.asarray(rng.standard_normal((7, heads, HEAD_DIM)), jnp.bfloat16)
               for heads in (2, 1, 1))  # fmt: skip
    starts, lengths = jnp.asarray([0, 1, 7], jnp.int32), jnp.asarray([25, 20], jnp.int32)
    args = (q, k, v, words, None, table, starts, lengths)
    # traced, so the API cannot check the table (a concrete one out of range raises)
    _, theirs = jax.jit(lambda *a: pf.ragged_attention(*a, backend="xla"))(*args)
    _, mine = SMALL.ragged_attention_and_write(
        q, k, v, pf.DecodeCache(words, None, table), starts, lengths,
        pf.RaggedSpec(sm_scale=HEAD_DIM**-0.5),
    )  # fmt: skip
    assert (mine.k == theirs.k).all()
    assert (theirs.k != words).any(), "the chunk's first tokens are written"


def test_bfloat16_queries_against_an_int8_cache() -> None:
    actual, expected, valid = _call([1, 11], [21, 30], dtype=jnp.bfloat16, int8=True, sinks=True)
    _check(actual, expected, valid, FORWARD_TOLERANCE["bfloat16"])


def test_default_tiling_through_the_api() -> None:
    """``pf.ragged_attention(backend="splitkv")``: the default blocks (one kv block per
    sequence here), int8, GQA, the new tokens written by core."""
    actual, expected, valid = _call([3, 1, 0], [20, 44, 0], tokens=6, int8=True, backend=None)
    _check(actual, expected, valid, 1e-4)


def test_schedule_gives_each_sequence_its_query_blocks() -> None:
    plan = schedule(jnp.array([0, 1, 1, 19, 21], jnp.int32), block_q=8, items=7)
    assert plan.sequence.tolist() == [0, 2, 2, 2, 3, 0, 0]
    assert plan.first.tolist() == [0, 1, 9, 17, 19, 0, 0]
    assert plan.count.tolist() == [1, 8, 8, 2, 2, 0, 0]


def test_decode_entries_are_taken_longest_first() -> None:
    """An item of several decoding sequences runs its longest one's kv blocks: the entries
    come longest first (ties in batch order), the unused ones after them."""
    starts = jnp.array([0, 1, 2, 5, 6, 7], jnp.int32)  # sequence 2 is a prefill chunk
    decoding = jnp.array([True, True, False, True, True])
    plan = ragged_blocks.schedule(starts, 1, 6, decoding)
    ordered = ragged_blocks.longest_first(plan, jnp.array([40, 9, 100, 33, 40], jnp.int32))
    assert ordered.sequence.tolist()[:4] == [0, 4, 3, 1]
    assert ordered.first.tolist()[:4] == [0, 6, 5, 1]
    assert ordered.count.tolist() == [1, 1, 1, 1, 0, 0]


@pytest.mark.parametrize("bad", [0, 4, 12, True])
def test_block_q_must_be_a_power_of_two_from_8(bad: int) -> None:
    with pytest.raises(ValueError, match="block_q"):
        RaggedBlocks(block_q=bad)


@pytest.mark.parametrize(
    ("window", "runs"),
    [
        (None, ((1, 2, 1), (3, 2, 1 + 1 + 1))),
        (20, ((1, 0, 2), (3, 0, 0, 1 + 1 + 2))),
        (40, ((1, 2, 1), (3, 1, 1, 1 + 1 + 1))),
    ],
)
def test_loop_runs_count_grid_steps_and_whole_and_masked_kv_blocks_per_group_of_kv_heads(
    window: int | None, runs: tuple[tuple[int, ...], ...]
) -> None:
    # blocks of 16 positions (2 pages of 8) and 8 tokens, 2 query heads a kv head; an empty
    # slot makes no item. The decode call takes a decode token at position 40: 3 blocks, the
    # first 2 whole; with a window of 20 it sees 20..40, 2 blocks, masked; of 40, 0..40, as
    # without one. The other call: 9 new tokens at 5..13 (items of 8 and 1, 1 masked block
    # each) and 3 at 45..47: 3 blocks, 2 whole; with a window of 20, 25..47, 2 masked; of 40,
    # 5..47: every row sees 7..45, so block 0 masked, 1 whole, 2 masked (a window's loops:
    # the masked blocks before the whole ones, the whole, the rest; the decode call's items,
    # of several sequences, have no loop before their whole blocks)
    starts = jnp.asarray([0, 1, 1, 10, 13], jnp.int32)
    lengths = jnp.asarray([41, 7, 14, 48], jnp.int32)
    spec = pf.RaggedSpec(sm_scale=1.0, window=window)
    shapes = dict(tokens=16, q_heads=4, kv_heads=2, head_dim=128, dtype=jnp.float32,
                  page_size=PAGE_SIZE, pages_per_sequence=PAGES_PER_SEQUENCE,
                  spec=spec)  # fmt: skip
    got = tuple(
        ragged_attention.loop_runs(
            starts, lengths, kernel=name, blocks=SMALL.ragged_blocks, **shapes
        )
        for name in (ragged_attention.DECODE_KERNEL_NAME, ragged_attention.KERNEL_NAME)
    )
    assert got == runs  # both kv heads in one grid step
    # one call for all, one kv head a grid step: each item's steps and blocks once per kv head
    one_call = RaggedBlocks(block_q=8, pages_per_block=2, decode_block_q=8, kv_heads_per_step=1)
    whole = ragged_attention.loop_runs(starts, lengths, kernel=ragged_attention.KERNEL_NAME,
                                    blocks=one_call, **shapes)  # fmt: skip
    decode = runs[0] if window is None else (runs[0][0], 0, *runs[0][1:])
    assert whole == tuple(2 * (a + b) for a, b in zip(decode, runs[1], strict=True))


def test_loop_runs_of_a_decode_only_batch() -> None:
    """Five decoding sequences, nothing else: two items of the decode call (4 sequences an
    item at 2 query heads a kv head, longest first: 2 blocks, then 1), and the other call,
    made with no entry, runs no loop."""
    starts = jnp.arange(6, dtype=jnp.int32)
    lengths = jnp.asarray([9, 17, 40, 3, 33], jnp.int32)
    shapes = dict(tokens=5, q_heads=4, kv_heads=2, head_dim=128, dtype=jnp.float32,
                  page_size=PAGE_SIZE, pages_per_sequence=PAGES_PER_SEQUENCE,
                  spec=pf.RaggedSpec(sm_scale=1.0), blocks=SMALL.ragged_blocks)  # fmt: skip
    decode = ragged_attention.loop_runs(
        starts, lengths, kernel=ragged_attention.DECODE_KERNEL_NAME, **shapes
    )
    # blocks of 16 positions: 40, 33, 17, 9 -> 3, 3, 2, 1 blocks (whole: 2, 2, 1, 0), then 3
    assert decode == (2, 0 + 0, 3 + 1)
    assert ragged_attention.loop_runs(
        starts, lengths, kernel=ragged_attention.KERNEL_NAME, **shapes
    ) == (0, 0, 0)


def test_prefill_items_hold_at_most_half_a_mebibyte_of_queries() -> None:
    automatic = RaggedBlocks()
    # 32 query rows a token (8 kv heads of 4) in bfloat16 at head_dim 128: 64 tokens, 512 KiB
    assert automatic.block_q_for(32, 256) == 64
    assert automatic.block_q_for(4, 256) == 128  # one kv head of 4: capped at 128 tokens
    assert automatic.block_q_for(32, 512) == 32  # float32 or head_dim 256: half as many
    assert automatic.block_q_for(1024, 1024) == 8  # at least 8
    assert RaggedBlocks(block_q=16).block_q_for(4, 256) == 16
    # no more than the batch: 174 tokens take items of 128, 7 tokens of 8 (the least)
    assert automatic.block_q_for(4, 256, 174) == 128
    assert automatic.block_q_for(4, 256, 256) == 128
    assert automatic.block_q_for(4, 256, 7) == 8
    assert RaggedBlocks(block_q=64).block_q_for(4, 256, 8) == 64  # a given size stays


def test_decoding_sequences_get_items_of_whole_row_tiles() -> None:
    blocks = RaggedBlocks()
    # whole tiles of 8 rows, towards 4 sequences within 16 rows
    assert [blocks.decode_rows_for(g) for g in (1, 2, 3, 4, 8, 16)] == [8, 4, 8, 4, 2, 1]
    assert RaggedBlocks(decode_block_q=2).decode_rows_for(4) == 2
    starts = jnp.asarray([0, 1, 7, 8], jnp.int32)
    # 8 tokens of 4 query heads over one kv head, head_dim 128 in bfloat16
    decode, rest = kernel_calls(starts, jax.ShapeDtypeStruct((8, 4, 128), jnp.bfloat16), 1, blocks)
    # items of 4 decoding sequences: 3 sequences' entries, in whole items
    assert (decode.block_q, decode.sequences, decode.items) == (4, 4, 4)
    assert decode.include.tolist() == [True, False, True]
    # the prefill call's items: the most tokens whose rows stay within 512 KiB, at most 256
    # and at most the batch's 8
    assert (rest.block_q, rest.items, rest.include.tolist()) == (8, 1 + 3, [False, True, False])
    one_head = jax.ShapeDtypeStruct((8, 1, 128), jnp.bfloat16)
    (whole,) = kernel_calls(starts, one_head, 1, RaggedBlocks(block_q=8))
    assert whole.include is None
    with pytest.raises(ValueError, match="decode_block_q must be a power of two"):
        RaggedBlocks(decode_block_q=3)
    assert [RaggedBlocks().heads_for(n) for n in (1, 2, 6, 8, 12, 32)] == [1, 2, 6, 8, 6, 8]
    with pytest.raises(ValueError, match="kv_heads_per_step must divide the kv heads"):
        RaggedBlocks(kv_heads_per_step=4).heads_for(6)
