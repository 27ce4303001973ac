"""`pallas_flash.page_write_kernel` in the TPU interpreter (DMAs simulated, races detected):
the same pool as one scatter of the tokens, for bfloat16, int8 and packed (uint32: a chunk of
one position) pages and float32 scales,
pages of one chunk and of several, runs that cross chunks and pages, chunks and pages written
whole and in part, tokens written nowhere (padding, no page) and more items than one group
takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import cache_write, page_write_kernel, page_write_plan
from pallas_flash.interpret import recorded_races

NEW_TOKENS = (1, 37, 0, 2, 16, 1, 70)
"""New tokens per sequence: decoding, a prefill chunk crossing chunks and pages, an empty slot,
two tokens, two whole chunks of bfloat16 (a whole page of 16), decoding, a prefill chunk
that fills a page of 64 (and four of 16)."""
CACHED = (5, 14, 3, 31, 32, 0, 60)
"""Positions each sequence holds before its new tokens."""
PADDING = 3


def _batch(page_size: int, num_pages: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``pages``, ``rows`` of the batch's tokens, each sequence's pages its own (shuffled, so
    that consecutive positions are not consecutive pages) and one page missing (-1)."""
    rng = np.random.default_rng(0)
    free = list(rng.permutation(num_pages))
    pages, rows = [], []
    for s, (new, cached) in enumerate(zip(NEW_TOKENS, CACHED, strict=True)):
        table = [free.pop() for _ in range(-(-(cached + new) // page_size))]
        if s == 1:
            table[-1] = -1  # the prefill chunk's last page is missing
        for position in range(cached, cached + new):
            pages.append(table[position // page_size])
            rows.append(position % page_size)
    pages += [num_pages] * PADDING  # padding: past the pool
    rows += [0] * PADDING
    return jnp.asarray(pages, jnp.int32), jnp.asarray(rows, jnp.int32)


WHOLE_PAGES = {
    (16, "bfloat16"): 7,  # the second sequence's 2, the fifth's 1 and the last's 4
    (64, "bfloat16"): 1,
    (16, "int8"): 0,  # pages of one chunk: a chunk item copies them whole
    (64, "int8"): 1,
    (16, "uint32"): 7,  # as bfloat16's: chunks of one position, pages of whole VMEM tiles
    (64, "uint32"): 1,
    (256, "float32"): 0,  # scales
}
"""Pages the batch writes whole, by page size and dtype of the pool."""


@pytest.mark.parametrize(
    ("page_size", "dtype", "head_dim", "kv_heads"),
    [
        (16, "bfloat16", 128, 2),
        (64, "bfloat16", 128, 2),
        (16, "bfloat16", 128, 1),
        (64, "bfloat16", 128, 1),
        (16, "int8", 128, 2),
        (64, "int8", 64, 2),
        (16, "uint32", 128, 2),
        (64, "uint32", 128, 1),
        (256, "float32", None, 2),
    ],
    ids=[
        "bf16-page16",
        "bf16-page64",
        "bf16-page16-one-head",
        "bf16-page64-one-head",
        "int8-page16",
        "int8-page64",
        "packed-page16",
        "packed-page64-one-head",
        "scales-page256",
    ],
)
def test_writes_what_one_scatter_writes(
    monkeypatch: pytest.MonkeyPatch,
    page_size: int,
    dtype: str,
    head_dim: int | None,
    kv_heads: int,
) -> None:
    """One kv head's keys and values are read stacked (`page_write_kernel._as_read`)."""
    monkeypatch.setattr(page_write_kernel, "MAX_ITEMS_PER_GROUP", 4)  # several groups
    num_pages = 32
    pages, rows = _batch(page_size, num_pages)
    tail = () if head_dim is None else (head_dim,)
    shape = (num_pages, kv_heads, page_size, *tail)
    pool = (jnp.arange(np.prod(shape)) % 7 + 1).reshape(shape).astype(dtype)
    values_shape = (pages.shape[0], kv_heads, *tail)
    values = (jnp.arange(np.prod(values_shape)) % 97 + 10).reshape(values_shape).astype(dtype)
    assert page_write_kernel.fits(pool, pages.shape[0])
    chunk_items, wholes = page_write_kernel.plan(pool, pages, rows, len(NEW_TOKENS), pools=2)
    assert int(chunk_items.count[0]) > 4  # several groups of chunk items
    assert int(wholes.count[0]) == WHOLE_PAGES[page_size, dtype]
    runs = page_write_kernel.loop_runs(pool, pages, rows, len(NEW_TOKENS), pools=2)
    used = int(chunk_items.count[0])
    assert runs[:4] == (-(-used // 4), used, used, used)  # groups of 4 (patched), then items
    per_group = page_write_kernel.whole_pages_per_group(pool, pages.shape[0], len(NEW_TOKENS), 2)
    whole = WHOLE_PAGES[page_size, dtype]
    tail = (-(-whole // per_group), whole, whole, whole) if per_group else ()
    assert runs[4:] == tail  # the pages written whole, where the kernel writes any
    interpret = pltpu.InterpretParams(detect_races=True)
    with recorded_races() as races:
        got = page_write_kernel.write_tokens_kernel(
            (pool, pool + 1),
            (values, values - 1),
            pages,
            rows,
            sequences=len(NEW_TOKENS),
            interpret=interpret,
        )
    assert [state.races_found for state in races] == [False]
    for written, before, new in zip(got, (pool, pool + 1), (values, values - 1), strict=True):
        expected = cache_write._scatter_tokens(before, new, pages, rows)
        np.testing.assert_array_equal(np.asarray(written), np.asarray(expected))
        assert not np.array_equal(np.asarray(written), np.asarray(before))


def test_items_are_runs_of_one_chunk() -> None:
    pages = jnp.asarray([3, 3, 3, 3, 5, -1, 7, 7, 9, 24], jnp.int32)  # 24: past a 24-page pool
    rows = jnp.asarray([14, 15, 16, 17, 0, 1, 2, 3, 0, 0], jnp.int32)
    plan = page_write_plan.items(pages, rows, num_pages=24, chunk=16)
    used = int(plan.count[0])
    assert used == 5
    assert plan.page.tolist()[:used] == [3, 3, 5, 7, 9]
    assert plan.start.tolist()[:used] == [0, 16, 0, 0, 0]
    assert plan.first_row.tolist()[:used] == [14, 0, 0, 2, 0]
    assert plan.first_token.tolist()[:used] == [0, 2, 4, 6, 8]
    assert plan.tokens.tolist()[:used] == [2, 2, 1, 2, 1]


def test_whole_pages_are_the_runs_that_fill_a_page() -> None:
    # pages of 4: page 3 filled by tokens 1-4, page 5 by 5-7 only (row 3 is not new), page 7
    # filled across two runs of one sequence is impossible; page 9's run is cut by padding
    pages = jnp.asarray([2, 3, 3, 3, 3, 5, 5, 5, 9, 9, 9, 24, 8, 8, 8, 8], jnp.int32)
    rows = jnp.asarray([3, 0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3], jnp.int32)
    whole = page_write_plan.whole(pages, rows, num_pages=24, page_size=4)
    assert whole.tolist() == [False] + [True] * 4 + [False] * 7 + [True] * 4
    plan = page_write_plan.whole_pages(pages, rows, 24, 4, whole)
    assert int(plan.count[0]) == 2
    assert plan.page.tolist()[:2] == [3, 8]
    assert plan.first_token.tolist()[:2] == [1, 12]


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_max_items_bounds_the_items_of_any_batch(chunk: int) -> None:
    rng = np.random.default_rng(chunk)
    count = jax.jit(lambda p, r: page_write_plan.items(p, r, 1000, chunk).count[0])
    for _ in range(40):
        new = rng.integers(0, 3 * chunk + 2, size=rng.integers(1, 9))
        cached = rng.integers(0, 4 * chunk + 2, size=new.shape)
        pages, rows = [], []
        for s, (n, c) in enumerate(zip(new, cached, strict=True)):
            positions = np.arange(c, c + n)
            pages += list(s * 100 + positions // (2 * chunk))  # pages of two chunks
            rows += list(positions % (2 * chunk))
        tokens = len(pages) + int(rng.integers(0, 4))  # and some padding
        if tokens == 0:
            continue
        padded = 8 * 9 * chunk + 16  # one shape for every batch: one compile
        pages += [-1] * (padded - len(pages))
        rows += [0] * (padded - len(rows))
        items = int(count(jnp.asarray(pages, jnp.int32), jnp.asarray(rows, jnp.int32)))
        assert items <= page_write_plan.max_items(tokens, len(new), chunk) <= tokens


def test_fits_paged_pools_and_takes_items_within_the_vmem_budget() -> None:
    assert page_write_kernel.chunk_positions(jnp.zeros((1, 1, 64, 128), jnp.bfloat16)) == 8
    assert page_write_kernel.chunk_positions(jnp.zeros((1, 1, 16, 128), jnp.int8)) == 16
    assert page_write_kernel.chunk_positions(jnp.zeros((1, 1, 64, 128), jnp.int8)) == 32
    assert page_write_kernel.chunk_positions(jnp.zeros((1, 1, 256), jnp.float32)) == 128
    assert not page_write_kernel.fits(jnp.zeros((4, 128), jnp.bfloat16), 8)
    assert not page_write_kernel.fits(jnp.zeros((4, 1, 16), jnp.float32), 8)  # scales: lanes
    big = jnp.zeros((1, 128, 16, 128), jnp.bfloat16)  # 256 KiB a chunk (8 rows)
    assert page_write_kernel.items_per_group(big, 512) == 16  # its rows and its chunk: 8 MiB
    assert page_write_kernel.items_per_group(big, 512, pools=2) == 8  # keys' and values'
    assert page_write_kernel.items_per_group(jnp.zeros((1, 8, 16, 128), jnp.bfloat16), 5) == 5
    huge = jnp.zeros((1, 2048, 16, 128), jnp.bfloat16)  # 4 MiB a chunk: keys' and values' 16
    assert not page_write_kernel.fits(huge, 1)


def test_writes_pages_whole_where_they_hold_several_chunks_and_fit_a_group() -> None:
    pool = jnp.zeros((1, 1, 128, 128), jnp.bfloat16)  # a page: 32 KiB, 16 chunks of 8 rows
    assert page_write_kernel.whole_pages_per_group(pool, 1270, 128, pools=2) == 9  # 1270 // 128
    assert page_write_kernel.whole_pages_per_group(pool, 127, pools=2) == 0  # no page filled
    # 1 MiB a page, 64 KiB a chunk: 32 chunk items take 8 MiB, which leaves one page's 4 MiB
    wide = jnp.zeros((1, 32, 128, 128), jnp.bfloat16)
    assert page_write_kernel.whole_pages_per_group(wide, 4096, pools=2) == 1
    assert page_write_kernel.whole_pages_per_group(wide, 4096, 2, pools=2) == 1
    assert page_write_kernel.whole_pages_per_group(wide, 4096, pools=1) == 4  # 8 MiB
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(page_write_kernel, "MAX_KERNEL_BYTES", 11 << 20)
        assert page_write_kernel.whole_pages_per_group(wide, 4096, pools=2) == 0  # 3 MiB left
    # a float32 page of 8 rows is 8 chunks of one row: 64 tokens fill 8 pages written whole
    assert page_write_kernel.whole_pages_per_group(jnp.zeros((1, 1, 8, 128)), 64) == 8
    assert page_write_kernel.whole_pages_per_group(jnp.zeros((1, 1, 256)), 512) == 0  # scales
    bf16_page = jnp.zeros((1, 1, 8, 128), jnp.bfloat16)  # one chunk
    assert page_write_kernel.whole_pages_per_group(bf16_page, 64) == 0
