"""tpu-inference's Ragged Paged Attention v3 on a mixed serving step (`rpa_mixed`): its
arguments and distribution, its blocks (vLLM's heuristic and the search), the runs of its
data-dependent loops, the cache writes' beside the compute chunks', and a compile for v5e."""

from __future__ import annotations

import pytest

from pallas_flash_bench.kernels import references, rpa_mixed, rpa_reference
from pallas_flash_bench.kernels.rpa_mixed import MixedBlocks, StepBlocks
from pallas_flash_bench.kernels.rpa_reference import DecodeBlocks
from pallas_flash_bench.kernels.sweeps import serving_step
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.aot.devices import libtpu_version

needs_rpa = pytest.mark.skipif(
    libtpu_version() is None or references._rpa_unavailable() is not None,
    reason="libtpu or tpu-inference is not installed",
)

# 4 decodes (lengths drawn in [100, 1000]) beside one chunk of 300 after 900 cached
SMALL = Workload("ragged", 2048, q_heads=32, kv_heads=8, batch=4, lengths=(100, 1000),
                 cache="paged", page_size=128, prefill=(1, 300), prefill_context=900)  # fmt: skip


def test_it_gets_the_step_in_its_own_layout_with_its_distribution() -> None:
    w = serving_step("vllm-512")
    q, k, v, cache, kv_lens, pages, cu_q_lens, distribution = rpa_mixed.arguments(w)
    assert q.shape == (512, 32, 128) and k.shape == v.shape == (512, 8, 128)
    assert cache.shape == (w.num_pages, 128, 8, 2, 128)  # K and V interleaved, 2 a word
    assert kv_lens.shape == (65,) and pages.shape == (65 * 64,) and cu_q_lens.shape == (66,)
    assert distribution.shape == (3,)
    # the 64 decodes in its decode kernel, the chunk in its mixed one
    assert rpa_mixed.distribution(w) == (64, 64, 65)


@needs_rpa  # vLLM's decode heuristic asks its kernel for its VMEM estimate
def test_its_blocks_are_vllms_heuristic_and_a_small_search() -> None:
    w = serving_step("vllm-512")
    vllm = StepBlocks(None, None)
    # decode: 16 MiB of K and V (4096 tokens at 8 kv heads); mixed at 512 tokens and 4 query
    # heads a kv head: 256 tokens a query block, computed 128 at a time, kv 1024 / 512
    assert vllm.decode_of(w) == DecodeBlocks(4096, 4096)
    assert vllm.mixed_of(w) == MixedBlocks(256, 1024, 128, 512)
    assert rpa_reference.decode_blocks(serving_step("vllm-512", 32, 32)) == (1024, 1024)
    assert vllm in rpa_mixed.BLOCKS["default"]
    assert {b._replace(unless=None) for b in rpa_mixed.BLOCKS["quick"]} <= set(
        rpa_mixed.BLOCKS["default"]
    )
    assert len(rpa_mixed.BLOCKS["default"]) >= 3
    assert vllm.label == "step: decode vLLM's; mixed vLLM's"
    assert all(rpa_mixed.applies(b, w) for b in rpa_mixed.BLOCKS["default"])
    # quick: exactly one configuration on every step, vLLM's heuristic where the sequences
    # are shorter than its decode blocks of 2048 (1024 shared + 256 tokens of its own)
    quick, fallback = rpa_mixed.BLOCKS["quick"]
    short = Workload(
        "ragged", 1280, q_heads=32, kv_heads=8, batch=4, lengths=(100, 1000), cache="paged",
        page_size=128, prefill=(1, 256), prefill_context=1024,
    )  # fmt: skip
    assert rpa_mixed.applies(quick, w) and not rpa_mixed.applies(fallback, w)
    assert not rpa_mixed.applies(quick, short) and rpa_mixed.applies(fallback, short)
    assert fallback.label.endswith("where step: decode kv blocks 2048, compute 1024; mixed "
                                   "vLLM's does not apply")  # fmt: skip
    assert not rpa_mixed.applies(vllm, Workload("decode", 8192))
    # its decode subjects do not take a step, nor its step subjects a decode batch
    assert not rpa_reference.applies(DecodeBlocks(2048, 1024), w)


@needs_rpa  # fits_vmem asks its kernel for its VMEM estimate
def test_its_widest_search_tries_every_decode_block_of_its_decode_rows() -> None:
    """The default search: vLLM's heuristic, each decode block of the decode rows' search
    with vLLM's mixed blocks, and mixed query blocks of 128; on a decode-only step (its mixed
    kernel runs no sequence) no configuration that differs only in its mixed blocks."""
    default = rpa_mixed.BLOCKS["default"]
    assert {b.decode for b in default if b.mixed is None} == {
        None,
        *rpa_reference.BLOCKS["default"],
    }
    assert len(set(default)) == len(default)
    decode_only = serving_step("decode", 4, 1, page_size=16)
    applying = [b for b in default if rpa_mixed.applies(b, decode_only)]
    assert applying == [b for b in default if b.mixed is None]
    mixed = serving_step("vllm-2048", 4, 1, page_size=16)
    assert [b for b in default if rpa_mixed.applies(b, mixed)] == default


def test_its_loops_run_as_its_kernels_walk_the_step() -> None:
    w = serving_step("vllm-512")  # the chunk: 448 new tokens at 1024..1471
    blocks = StepBlocks(DecodeBlocks(2048, 1024), MixedBlocks(256, 1024, 128, 512))
    # RPAm, in program order: 1 sequence, 2 query blocks (256 + 192 tokens); the first sees
    # 1280 positions (2 kv blocks, chunks 2 + 1), the second 1472 (2 blocks, chunks 2 + 1);
    # the cache writes of the last query block walk the 4 pages of 128 at 1024..1471
    assert rpa_mixed.loop_trips(blocks, w, "RPAm-p_128-bq_256_128-bkv_1024_512.1") == (
        1, 2, 4, 4, 6,
    )  # fmt: skip
    # RPAd: the 64 decodes, their kv blocks and chunks, one page written each
    lengths = [int(n) for n in w.sequence_lengths[:64]]
    decode = rpa_mixed.loop_trips(blocks, w, "RPAd-p_128-bq_1_1-bkv_2048_1024.1")
    assert decode == (
        64,
        sum(-(-n // 2048) for n in lengths),
        64,
        sum(-(-n // 1024) for n in lengths),
    )
    assert rpa_mixed.loop_trips(blocks, w, "fusion.1") is None


def test_a_chunk_across_kv_blocks_writes_the_pages_of_each() -> None:
    # 300 new tokens at 900..1199 over kv blocks of 1024, pages of 128: block 0 holds
    # 900..1023 (pages 7), block 1 1024..1199 (pages 8, 9); one query block of 512
    trips = rpa_reference.sequence_trips(300, 1200, 512, 1024, 512, 128, update=True)
    assert trips == rpa_reference.Trips(1, 1, 2, 3, 3)
    # without the writes (its decode rows: the cache holds the new token) none
    assert rpa_reference.sequence_trips(1, 1200, 1, 1024, 512, 128, update=False) == (
        1, 1, 2, 3, 0,
    )  # fmt: skip


def test_a_windowed_layer_starts_each_query_block_at_its_window() -> None:
    # 448 new tokens at 3072..3519, a window of 1024: both query blocks (3072.., 3328..) start
    # at kv block 2 (2048..), so 2 kv blocks and 2 + 1 chunks each against 4 and 2+2+2+1
    # unwindowed; the writes, 4 pages of 128 at 3072..3519, are the same
    windowed = rpa_reference.sequence_trips(448, 3520, 256, 1024, 512, 128, update=True,
                                            window=1024)  # fmt: skip
    assert windowed == rpa_reference.Trips(1, 2, 4, 6, 4)
    assert rpa_reference.sequence_trips(448, 3520, 256, 1024, 512, 128, update=True) == (
        1, 2, 8, 14, 4,
    )  # fmt: skip
    # a decode at 4999 sees 3975..4999: kv blocks 3 and 4 (904 positions), 2 chunks each
    assert rpa_reference.sequence_trips(1, 5000, 1, 1024, 512, 128, update=False,
                                        window=1024) == (1, 1, 2, 4, 0)  # fmt: skip


@pytest.mark.skipif(references._rpa_unavailable() is not None, reason="no tpu-inference")
def test_its_window_and_ours_less_one_mask_the_same_positions() -> None:
    """RPA v3's own reference (``ref_ragged_paged_attention``) with ``sliding_window=5`` and
    ``pf.ragged_attention`` with ``rpa_window - 1`` (`ragged_step.pf_window`) give one output on
    a decode of 20 positions and a chunk of 6 after 10, pages of 8, each cache in its layout."""
    import jax.numpy as jnp
    import numpy as np

    import pallas_flash as pf
    from pallas_flash_bench.kernels import ragged_step

    rng = np.random.default_rng(0)
    heads, kv_heads, dim, page, window = 4, 2, 128, 8, 5
    lengths, new = np.array([20, 16]), np.array([1, 6])
    pages = np.array([[1, 2, 3], [4, 5, 0]])  # page 0 is never read
    keys, values = (rng.standard_normal((2, 24, kv_heads, dim), np.float32) for _ in range(2))
    rows = [np.arange(n - q, n) for n, q in zip(lengths, new, strict=True)]
    q = jnp.asarray(rng.standard_normal((7, heads, dim), np.float32))
    k, v = (jnp.asarray(np.concatenate([x[s, r] for s, r in enumerate(rows)]))
            for x in (keys, values))  # fmt: skip
    # the cache before the step: each sequence's positions before its new tokens
    ours = np.zeros((2, 6, kv_heads, page, dim), np.float32)  # K and V, [pages, heads, page, dim]
    theirs = np.zeros((6, page, 2 * kv_heads, 1, dim), np.float32)
    for s in range(2):
        for p in range(lengths[s] - new[s]):
            at = pages[s, p // page], p % page
            ours[0, at[0], :, at[1]], ours[1, at[0], :, at[1]] = keys[s, p], values[s, p]
            theirs[at[0], at[1], 0::2, 0], theirs[at[0], at[1], 1::2, 0] = keys[s, p], values[s, p]
    starts = jnp.asarray([0, 1, 7], jnp.int32)
    want, _ = rpa_reference.load_kernel().ref_ragged_paged_attention(
        q, k, v, jnp.asarray(theirs), jnp.asarray(lengths, jnp.int32),
        jnp.asarray(pages.reshape(-1), jnp.int32), starts, jnp.asarray([1, 1, 2], jnp.int32),
        sm_scale=dim**-0.5, sliding_window=window,
    )  # fmt: skip
    step = Workload("ragged", 24, batch=1, cache="paged", page_size=page, prefill=(1, 6),
                    sliding_window=window)  # fmt: skip
    got, _ = pf.ragged_attention(
        q, k, v, jnp.asarray(ours[0]), jnp.asarray(ours[1]), jnp.asarray(pages, jnp.int32),
        starts, jnp.asarray(lengths, jnp.int32), sliding_window=ragged_step.pf_window(step),
        backend="xla",
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    wider, _ = pf.ragged_attention(
        q, k, v, jnp.asarray(ours[0]), jnp.asarray(ours[1]), jnp.asarray(pages, jnp.int32),
        starts, jnp.asarray(lengths, jnp.int32), sliding_window=window, backend="xla",
    )  # fmt: skip
    assert not np.allclose(np.asarray(wider), np.asarray(want), atol=1e-3)  # one more seen


@needs_rpa
def test_it_compiles_for_v5e_and_charges_both_kernels_their_runs(run_row) -> None:
    assert rpa_mixed.applies(rpa_mixed.BLOCKS["quick"][0], SMALL)
    subject, _ = [s for s in references.reference_subjects("quick") if s.config.startswith("step")]
    row = run_row(subject, SMALL)
    assert row["compiled"], row["error"]
    decode, mixed = row["kernels"]
    assert decode["name"].startswith("RPAd-") and mixed["name"].startswith("RPAm-")
    for k in (decode, mixed):  # every loop charged its runs, the writes' beside the chunks'
        assert k["cycles_from"].startswith("loops whose trip counts read memory"), k
    assert "(4, 4, 4, 4 runs" in decode["cycles_from"]
    # the chunk (`test_a_chunk_across_kv_blocks_writes_the_pages_of_each`) in query blocks of
    # 256 (vLLM's at 304 tokens), each seeing 2 kv blocks, 3 chunks
    assert "(1, 2, 4, 3, 6 runs" in mixed["cycles_from"]
    # the cache is donated, written in place: no copy of it
    cache = "bf16[" + ",".join(map(str, rpa_reference.cache_shape(SMALL))) + "]"
    assert not any(c["shape"].startswith(cache) for c in row["copies"]), row["copies"]
    assert not any("LOWER bound" in n for n in row["notes"])
