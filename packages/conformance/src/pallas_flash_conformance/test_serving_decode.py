"""Serving caches through ``pf.decode``: paged caches read through a page table, int8 caches
with per-token scales, and the bad input each brings.

Pages are handed out in shuffled order, every pool page no sequence uses and every slot past a
sequence's length holds NaN (a kernel that reads them, or gives them weight, fails), and the
lengths include 0, one position, a page edge and the whole table. int8 caches are compared with
the float64 reference of their dequantized values (what the cache holds), and separately with
the float cache they were quantized from (what quantizing costs).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close

pytestmark = pytest.mark.requires("decode")

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 5, 8, 2, 64
PAGE_SIZE, PAGES_PER_SEQUENCE = 16, 5  # 80 positions per sequence
LENGTHS = [0, 1, 16, 80, 37]  # empty, one token, one whole page, the whole table, ragged


def _paged(
    dtype: str, lengths=LENGTHS, page_size: int = PAGE_SIZE, seed: int = 0
) -> tuple[jax.Array, jax.Array, np.ndarray, np.ndarray]:
    """Pages ``[num_pages, kv_heads, page_size, head_dim]`` for K and V, a shuffled table
    using a subset of the pool, and the contiguous ``[batch, kv_heads, max_len, head_dim]``
    K/V that the table describes (float64). Unused pages and slots hold NaN."""
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    num_pages = 2 * batch * PAGES_PER_SEQUENCE  # half the pool is never handed out
    table = rng.permutation(num_pages)[: batch * PAGES_PER_SEQUENCE].reshape(batch, -1)
    shape = (num_pages, KV_HEADS, page_size, HEAD_DIM)
    pools = []
    for s in (1, 2):
        pool = np.array(inputs.normal(seed + s, shape, dtype), np.float32)
        valid = np.zeros(shape[:3], bool)
        for b, length in enumerate(lengths):
            for j in range(math.ceil(length / page_size)):
                valid[table[b, j], :, : min(page_size, length - j * page_size)] = True
        pool[~valid] = np.nan
        pools.append(pool)
    contiguous = [reference.gather_pages(np.nan_to_num(pool), table) for pool in pools]
    k_pages, v_pages = (jnp.asarray(pool, inputs.DTYPES[dtype]) for pool in pools)
    return k_pages, v_pages, table.astype(np.int32), contiguous


def _expected(q, k, v, lengths, softcap=None) -> np.ndarray:
    return reference.decode(
        q, k, v, np.asarray(lengths), sm_scale=1 / math.sqrt(HEAD_DIM), softcap=softcap
    )


def _assert_zero_where_empty(out: jax.Array, lengths) -> None:
    for b, length in enumerate(lengths):
        if length == 0:
            assert (np.asarray(out[b], np.float32) == 0).all(), "an empty sequence gives zeros"


@pytest.mark.requires("paged_cache")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_cache_with_shuffled_pages(backend, dtype: str) -> None:
    q = inputs.normal(0, (BATCH, Q_HEADS, HEAD_DIM), dtype)
    k_pages, v_pages, table, (k, v) = _paged(dtype)
    out = pf.decode(q, k_pages, v_pages, LENGTHS, page_table=table, backend=backend.name)
    assert out.dtype == q.dtype
    assert_close(out, _expected(q, k, v, LENGTHS), FORWARD_TOLERANCE[dtype])
    _assert_zero_where_empty(out, LENGTHS)


@pytest.mark.requires("paged_cache", "packed_cache", "gqa")
def test_packed_cache_with_shuffled_pages(backend) -> None:
    """A bfloat16 pool packed (keys and values in one uint32 array, ``v_cache=None``), its
    unused pages and slots NaN in both halves; under jit with the lengths traced."""
    q = inputs.normal(0, (BATCH, Q_HEADS, HEAD_DIM), "bfloat16")
    k_pages, v_pages, table, (k, v) = _paged("bfloat16")
    words = pf.pack_kv(k_pages, v_pages)
    step = jax.jit(lambda lengths: pf.decode(q, words, None, lengths, page_table=table,
                                             backend=backend.name))  # fmt: skip
    out = step(np.asarray(LENGTHS, np.int32))
    assert out.dtype == q.dtype
    assert_close(out, _expected(q, k, v, LENGTHS), FORWARD_TOLERANCE["bfloat16"])
    _assert_zero_where_empty(out, LENGTHS)


@pytest.mark.requires("paged_cache", "softcap")
def test_paged_cache_under_jit_with_traced_lengths_and_table(backend) -> None:
    q = inputs.normal(0, (BATCH, Q_HEADS, HEAD_DIM), scale=3.0)
    k_pages, v_pages, table, (k, v) = _paged("float32")

    @jax.jit
    def step(lengths, table):
        return pf.decode(
            q, k_pages, v_pages, lengths, page_table=table, softcap=2.0, backend=backend.name
        )

    out = step(np.asarray(LENGTHS, np.int32), table)
    assert_close(out, _expected(q, k, v, LENGTHS, softcap=2.0), FORWARD_TOLERANCE["float32"])


@pytest.mark.requires("paged_cache")
def test_traced_page_indices_out_of_range_are_clipped(backend) -> None:
    """Under jit the table cannot be checked: an index outside the pool reads the nearest
    page (the first or last), never memory outside the cache."""
    q = inputs.normal(0, (2, Q_HEADS, HEAD_DIM))
    pool = [inputs.normal(s, (4, KV_HEADS, PAGE_SIZE, HEAD_DIM)) for s in (1, 2)]
    table = np.array([[-5, 1], [2, 1000]], np.int32)
    lengths = np.array([20, 32], np.int32)
    out = jax.jit(
        lambda table: pf.decode(q, *pool, lengths, page_table=table, backend=backend.name)
    )(table)
    clipped = np.clip(table, 0, 3)
    k, v = (reference.gather_pages(x, clipped) for x in pool)
    assert_close(out, _expected(q, k, v, lengths), FORWARD_TOLERANCE["float32"])


@pytest.mark.requires("paged_cache", "gqa")
def test_paged_cache_mqa_with_large_pages(backend) -> None:
    """One kv head for every query head; pages of 128 positions, lengths across pages."""
    q = inputs.normal(0, (3, Q_HEADS, HEAD_DIM), "bfloat16")
    pool = [inputs.normal(s, (7, 1, 128, HEAD_DIM), "bfloat16") for s in (1, 2)]
    table = np.array([[6, 0], [3, 5], [1, 2]], np.int32)
    lengths = np.array([256, 129, 3], np.int32)
    out = pf.decode(q, *pool, lengths, page_table=table, backend=backend.name)
    k, v = (reference.gather_pages(np.asarray(x, np.float32), table) for x in pool)
    assert_close(out, _expected(q, k, v, lengths), FORWARD_TOLERANCE["bfloat16"])


def _quantized(k: np.ndarray, v: np.ndarray) -> tuple[jax.Array, ...]:
    """int8 K, V and their scales; NaN rows (unused slots) get NaN scales."""
    k8, k_scales = pf.quantize_int8(jnp.asarray(np.nan_to_num(k)))
    v8, v_scales = pf.quantize_int8(jnp.asarray(np.nan_to_num(v)))
    k_scales = jnp.where(jnp.isnan(jnp.asarray(k)).any(-1), jnp.nan, k_scales)
    v_scales = jnp.where(jnp.isnan(jnp.asarray(v)).any(-1), jnp.nan, v_scales)
    return k8, v8, k_scales, v_scales


@pytest.mark.requires("int8_cache", "gqa")
def test_int8_contiguous_cache_matches_its_dequantized_values(backend) -> None:
    max_len = 256  # blocks of 128 positions or more: splitkv pairs int8 rows (`int8_rows`)
    lengths = np.array([0, 1, 256, 77], np.int32)
    q = inputs.normal(0, (4, Q_HEADS, HEAD_DIM), "bfloat16")
    k, v = (np.array(inputs.normal(s, (4, KV_HEADS, max_len, HEAD_DIM))) for s in (1, 2))
    for b, length in enumerate(lengths):
        k[b, :, length:] = v[b, :, length:] = np.nan  # stale slots: NaN scales
    k8, v8, k_scales, v_scales = _quantized(k, v)
    out = pf.decode(q, k8, v8, lengths, k_scales=k_scales, v_scales=v_scales, backend=backend.name)
    assert out.dtype == q.dtype
    expected = _expected(
        q, reference.dequantize(k8, np.nan_to_num(k_scales)),
        reference.dequantize(v8, np.nan_to_num(v_scales)), lengths,
    )  # fmt: skip
    assert_close(out, expected, FORWARD_TOLERANCE["bfloat16"])
    _assert_zero_where_empty(out, lengths)


@pytest.mark.requires("int8_cache", "paged_cache", "gqa")
def test_int8_paged_cache_matches_its_dequantized_values(backend) -> None:
    q = inputs.normal(0, (BATCH, Q_HEADS, HEAD_DIM), "bfloat16")
    k_pages, v_pages, table, _ = _paged("float32")
    k8, v8, k_scales, v_scales = _quantized(np.asarray(k_pages), np.asarray(v_pages))
    out = pf.decode(
        q, k8, v8, LENGTHS, page_table=table, k_scales=k_scales, v_scales=v_scales,
        backend=backend.name,
    )  # fmt: skip
    k, v = (
        reference.gather_pages(reference.dequantize(x, np.nan_to_num(s)), table)
        for x, s in ((k8, k_scales), (v8, v_scales))
    )
    assert_close(out, _expected(q, k, v, LENGTHS), FORWARD_TOLERANCE["bfloat16"])
    _assert_zero_where_empty(out, LENGTHS)


def _placed(
    pool: jax.Array, table: np.ndarray, device_of, devices: int
) -> tuple[jax.Array, np.ndarray]:
    """``pool`` and ``table`` with page ``j`` of sequence ``b`` moved to device
    ``device_of(b, j)`` of a pool split in ``devices`` slices of as many pages as the table
    (those no sequence uses NaN)."""
    per_device = table.size
    moved = np.full((per_device * devices, *pool.shape[1:]), np.nan, np.float32)
    placed, used = np.zeros_like(table), [0] * devices
    for (b, j), page in np.ndenumerate(table):
        device = device_of(b, j) % devices
        placed[b, j] = per_device * device + used[device]
        used[device] += 1
        moved[placed[b, j]] = np.asarray(pool[page], np.float32)
    return jnp.asarray(moved), placed


@pytest.mark.requires("paged_cache", "multi_device", "gqa")
@pytest.mark.parametrize("page_size", [PAGE_SIZE, 128])
@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize(
    "layout", ["round", "crowded"], ids=["pages-round-the-devices", "sequence-per-device"]
)
def test_decode_paged_over_a_mesh(backend, dtype: str, layout: str, page_size: int) -> None:
    """The pool's pages split over every device (one device: no split): each sequence's page
    ``j`` on device ``j + b`` (as `PagedKVCache` spreads them), or every page of sequence ``b``
    on device ``b`` (a device holds more of a sequence than its share); NaN in every unused
    page and slot; int8 against its dequantized values; pages of 16 and 128 positions (a
    kernel may read several of the latter at once). (Named ``test_decode_*``: CI's run on
    several host devices selects these.)"""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("kv",))
    _check_paged_over(mesh, backend.name, dtype, layout, page_size)


@pytest.mark.requires("paged_cache", "multi_device", "gqa")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("int8", marks=pytest.mark.requires("int8_cache"))]
)
def test_decode_paged_over_jax_make_mesh_takes_numpy(backend, dtype: str, jit: bool) -> None:
    """A mesh from ``jax.make_mesh`` (axes ``Explicit`` on this jax) and a pool, table and
    scales given as NumPy arrays, eager and under the user's jit: laid out over the mesh by
    the backend."""
    mesh = jax.make_mesh((jax.device_count(),), ("kv",))
    _check_paged_over(mesh, backend.name, dtype, "round", PAGE_SIZE, as_numpy=True, jit=jit)


def _check_paged_over(
    mesh, backend: str, dtype: str, layout: str, page_size: int, *, as_numpy=False, jit=False
) -> None:
    """Decodes from a pool split over ``mesh`` (``layout``: how the pages lie, see
    `test_decode_paged_over_a_mesh`) and checks it against the reference."""
    q = inputs.normal(0, (BATCH, Q_HEADS, HEAD_DIM))
    lengths = [n * page_size // PAGE_SIZE for n in LENGTHS]
    k_pages, v_pages, table, (k, v) = _paged("float32", lengths, page_size)
    device_of = (lambda b, j: j + b) if layout == "round" else (lambda b, j: b)
    (k_pages, _), (v_pages, table) = (
        _placed(x, table, device_of, mesh.size) for x in (k_pages, v_pages)
    )
    scales = {}
    if dtype == "int8":
        k_pages, v_pages, scales["k_scales"], scales["v_scales"] = _quantized(
            np.asarray(k_pages), np.asarray(v_pages)
        )
        k, v = (
            reference.gather_pages(reference.dequantize(x, np.nan_to_num(scales[name])), table)
            for x, name in ((k_pages, "k_scales"), (v_pages, "v_scales"))
        )
    arrays = (q, k_pages, v_pages, np.asarray(lengths, np.int32), table, scales)
    if as_numpy:
        arrays = jax.tree.map(np.asarray, arrays)

    def call(q, k_pages, v_pages, lengths, table, scales):
        return pf.decode(q, k_pages, v_pages, lengths, page_table=table, backend=backend,
                         mesh=mesh, **scales)  # fmt: skip

    out = (jax.jit(call) if jit else call)(*arrays)
    tolerance = FORWARD_TOLERANCE["float32" if dtype == "float32" else "bfloat16"]
    assert_close(out, _expected(q, k, v, lengths), tolerance)
    _assert_zero_where_empty(out, lengths)


INT8_ERROR = {"normal": 0.015, "outliers": 0.04}
"""Largest relative RMS error of an int8 cache's output against the float cache it was
quantized from. Measured (xla and splitkv alike, head_dim 64, 256 positions, 3 seeds): 0.85-0.95%
on normal K/V (a bfloat16 cache: 0.3-0.4%), 1.7-3.4% when each K row holds 4 channels 20x
larger than the rest (bfloat16: 0.5-0.6%): a row's scale follows its largest value, so the
outlier channels coarsen the others."""


@pytest.mark.requires("int8_cache", "gqa")
@pytest.mark.parametrize("data", ["normal", "outliers"])
def test_int8_cache_error_against_the_float_cache(backend, data: str) -> None:
    """What quantizing costs: random normal K/V, and K whose rows each hold a few channels
    20x larger than the rest (as the K of real models do)."""
    max_len = 256
    lengths = np.array([256, 100], np.int32)
    q = inputs.normal(0, (2, Q_HEADS, HEAD_DIM))
    k, v = (np.array(inputs.normal(s, (2, KV_HEADS, max_len, HEAD_DIM))) for s in (1, 2))
    if data == "outliers":
        channels = np.random.default_rng(3).choice(HEAD_DIM, 4, replace=False)
        k[..., channels] *= 20.0
        q = q / 4.0  # keep the softmax from collapsing onto a single key
    k8, v8, k_scales, v_scales = _quantized(k, v)
    out = pf.decode(q, k8, v8, lengths, k_scales=k_scales, v_scales=v_scales, backend=backend.name)
    expected = _expected(q, k, v, lengths)
    error = np.sqrt(np.mean((np.asarray(out, np.float64) - expected) ** 2) / np.mean(expected**2))
    assert error < INT8_ERROR[data], f"int8 cache relative RMS error {error:.4f} on {data} data"


def _call(backend, **overrides) -> None:
    """pf.decode of a small paged int8 cache with one argument replaced."""
    pool = jnp.zeros((4, KV_HEADS, PAGE_SIZE, HEAD_DIM), jnp.int8)
    scales = jnp.ones((4, KV_HEADS, PAGE_SIZE), jnp.float32)
    args = dict(
        q=jnp.zeros((2, Q_HEADS, HEAD_DIM)),
        k_cache=pool,
        v_cache=pool,
        lengths=np.array([20, 32], np.int32),
        page_table=np.array([[0, 1], [2, 3]], np.int32),
        k_scales=scales,
        v_scales=scales,
    )
    args.update(overrides)
    pf.decode(**args, backend=backend.name)


@pytest.mark.requires("int8_cache", "paged_cache")
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"page_table": np.array([[0, 4], [2, 3]], np.int32)},
            r"^page_table: .*page 4 at \[0, 1\]",
        ),
        ({"lengths": np.array([20, 33], np.int32)}, r"^lengths: expected values in \[0, 32: "),
        ({"page_table": np.array([[0], [2]], np.int32)}, r"^lengths: .*pages_per_sequence=1 x"),
        (
            {"k_scales": jnp.ones((4, KV_HEADS, 8), jnp.float32)},
            r"^k_scales: .*got shape \(4, 2, 8\)",
        ),
        ({"v_scales": None}, r"^v_scales: expected float32 .* got None"),
    ],
    ids=["page-out-of-range", "length-past-table", "table-too-short", "scale-shape", "no-scales"],
)
def test_bad_serving_input_raises_a_named_error(backend, overrides: dict, message: str) -> None:
    with pytest.raises(pf.InvalidInputError, match=message):
        _call(backend, **overrides)
