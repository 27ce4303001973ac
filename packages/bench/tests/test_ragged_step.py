"""A mixed serving step (`ragged_step`): its tokens, sequences, pages, useful flops and least
HBM bytes; the sweep of them; and our backends' build for it (``pf.ragged_attention``, the
cache donated)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_bench.kernels import backend_kernels, ragged_step, row_figures, subjects
from pallas_flash_bench.kernels.sweeps import (
    SERVING_LENGTHS,
    default_sweep,
    quick_sweep,
    ragged_sweep,
    serving_step,
    step_sweep,
    window_sweep,
)
from pallas_flash_bench.kernels.workloads import Workload

# 3 decodes of 5, 17 and 40 positions (the new token included) beside 2 chunks of 6 after 10
STEP = Workload("ragged", 64, q_heads=4, kv_heads=2, head_dim=8, batch=3, lengths=(5, 40),
                cache="paged", page_size=16, prefill=(2, 6), prefill_context=10)  # fmt: skip
# the same step in a layer whose tokens see 8 positions each, their own included
WINDOWED = dataclasses.replace(STEP, sliding_window=8)


@pytest.fixture(autouse=True)
def _fixed_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = {STEP: np.array([5, 17, 40]), WINDOWED: np.array([5, 17, 40])}
    drawn = Workload.drawn_lengths
    monkeypatch.setattr(Workload, "drawn_lengths", lambda w: lengths.get(w, drawn(w)))


def test_a_step_is_its_decodes_then_its_chunks() -> None:
    assert list(ragged_step.query_lengths(STEP)) == [1, 1, 1, 6, 6]
    assert list(ragged_step.kv_lengths(STEP)) == [5, 17, 40, 16, 16]
    assert list(STEP.sequence_lengths) == [5, 17, 40, 16, 16]
    assert list(ragged_step.query_starts(STEP)) == [0, 1, 2, 3, 9, 15]
    assert STEP.tokens == 15
    assert STEP.num_pages == 1 + 2 + 3 + 1 + 1  # pages of 16
    table = ragged_step.page_table(STEP)
    assert table.shape == (5, 4) and sorted(table[table > 0].tolist()) == list(range(1, 8))
    assert table[2, :3].tolist() == [3, 4, 5]  # its own pages, in order
    shuffled = ragged_step.page_table(STEP, np.random.default_rng(0))
    assert sorted(shuffled[[0, 1, 1, 2, 2, 2, 3, 4], [0, 0, 1, 0, 1, 2, 0, 0]]) == list(range(8))
    assert STEP.label == "ragged T=15 H4/2 prefill 2x6 after 10 + decode 3 lengths 5..40 paged/16"


def test_its_flops_count_the_pairs_its_causal_mask_lets_through() -> None:
    # decodes see their whole lengths; a chunk's tokens at 10..15 see 11..16 positions
    pairs = 5 + 17 + 40 + 2 * sum(range(11, 17))
    assert ragged_step.visible_pairs(STEP) == pairs
    assert STEP.useful_flops == 4.0 * 4 * 8 * pairs


def test_it_moves_at_least_its_tokens_twice_and_the_cache_before_them_once() -> None:
    per_token = 2 * 2 * 8 * 2  # K and V, 2 kv heads of 8, bfloat16
    cached = 4 + 16 + 39 + 10 + 10
    queries = 15 * 4 * 8 * 2
    assert STEP.min_hbm_bytes == 2 * queries + per_token * (2 * 15 + cached)


def test_it_is_a_paged_floating_point_step_on_one_chip_and_survives_json() -> None:
    assert Workload(**json.loads(json.dumps(STEP.to_json()))) == STEP
    for bad in (dict(cache="contiguous"), dict(cache_dtype="int8"), dict(prefill=(1, 60))):
        with pytest.raises(ValueError, match="ragged"):
            Workload(**{**STEP.to_json(), **bad})
    with pytest.raises(ValueError, match="ragged only"):
        Workload("decode", 64, prefill=(1, 8))


def test_a_windowed_step_sees_and_reads_only_its_window() -> None:
    # a token sees at most 8 positions: the decodes 5, 8 and 8; the chunks' tokens at 10..15
    # 8 each
    assert ragged_step.visible_pairs(WINDOWED) == 5 + 8 + 8 + 2 * 6 * 8
    assert ragged_step.pf_window(WINDOWED) == 7 and ragged_step.pf_window(STEP) is None
    # the cached positions before each first new token, at most 7 of them
    per_token = 2 * 2 * 8 * 2
    cached = 4 + 7 + 7 + 7 + 7
    queries = 15 * 4 * 8 * 2
    assert WINDOWED.min_hbm_bytes == 2 * queries + per_token * (2 * 15 + cached)
    assert WINDOWED.label == STEP.label + " window 8"
    assert WINDOWED.to_json()["sliding_window"] == 8 and "sliding_window" not in STEP.to_json()
    assert Workload(**json.loads(json.dumps(WINDOWED.to_json()))) == WINDOWED
    with pytest.raises(ValueError, match="sliding_window: expected at least 1"):
        dataclasses.replace(STEP, sliding_window=0)
    with pytest.raises(ValueError, match="ragged only"):
        Workload("decode", 64, sliding_window=8)


def test_our_backends_run_a_windowed_step_with_pf_s_window() -> None:
    """The build hands ``pf.ragged_attention`` the window less one (`ragged_step.pf_window`):
    each token sees the 8 positions up to its own, as a float64 softmax over them says."""
    from pallas_flash_bench.runs import measure

    arrays = measure.random_arrays(subjects.array_specs(WINDOWED), WINDOWED)
    out, _ = subjects.backend_subjects(["xla"])[0].build(WINDOWED, None)(*arrays)
    k_cache, v_cache = pf.unpack_kv(arrays[3], WINDOWED.dtype)  # the packed pool
    arrays = [*arrays[:3], k_cache, v_cache, *arrays[4:]]
    q, k, v, k_cache, v_cache, table, starts, lengths = (np.asarray(a, np.float64) for a in arrays)
    for s, (lo, hi) in enumerate(zip(starts[:-1].astype(int), starts[1:].astype(int), strict=True)):
        n, length = hi - lo, int(lengths[s])
        pages = table[s].astype(int)
        keys = k_cache[pages].transpose(1, 0, 2, 3).reshape(2, -1, 8)[:, :length].copy()
        values = v_cache[pages].transpose(1, 0, 2, 3).reshape(2, -1, 8)[:, :length].copy()
        keys[:, length - n :] = k[lo:hi].transpose(1, 0, 2)
        values[:, length - n :] = v[lo:hi].transpose(1, 0, 2)
        for t in range(n):
            p = length - n + t
            seen = slice(max(0, p - 7), p + 1)
            for h in range(4):
                scores = keys[h // 2, seen] @ q[lo + t, h] / np.sqrt(8)
                weights = np.exp(scores - scores.max())
                want = weights @ values[h // 2, seen] / weights.sum()
                np.testing.assert_allclose(np.asarray(out[lo + t, h], np.float64), want, atol=2e-2)


def test_the_default_sweep_has_vllm_and_jetstream_steps_and_the_quick_one_none() -> None:
    steps = ragged_sweep()
    assert {(w.q_heads, w.kv_heads) for w in steps} == {(32, 8), (32, 32)}
    assert {w.tokens for w in steps} == {512, 2048, 608}
    assert {w.page_size for w in steps} == {128, 16}
    assert all(w.lengths == SERVING_LENGTHS and w.seq_len == 8192 for w in steps)
    assert set(steps) <= set(default_sweep()) and len(set(steps)) == len(steps)
    assert not [w for w in quick_sweep() if w.op == "ragged"]
    vllm = serving_step("vllm-512")
    assert vllm in steps and vllm.batch == 64 and vllm.prefill == (1, 448)


def test_the_other_workloads_record_what_they_did_before_mixed_steps() -> None:
    assert "prefill" not in Workload("decode", 64).to_json()
    assert "prefill_context" not in Workload("forward", 64).to_json()


def test_our_backends_run_it_through_ragged_attention_with_the_cache_donated() -> None:
    """A bfloat16 step's cache is one packed pool (`ragged_step.packed`), as the engine keeps
    it; a float32 step's is K's and V's."""
    specs = subjects.array_specs(STEP)
    assert specs[3].dtype == "uint32" and specs[4].dtype == "int32"
    assert [s.shape for s in specs] == [
        (15, 4, 8), (15, 2, 8), (15, 2, 8), (8, 2, 16, 8), (5, 4), (6,), (5,),
    ]  # fmt: skip
    backends = {s.name: s for s in subjects.backend_subjects()}
    xla = backends["xla"]
    assert xla.donate(STEP) == (3,) and xla.donate(Workload("decode", 64)) == ()
    assert xla.build(STEP, None) is not None
    float32 = dataclasses.replace(STEP, dtype="float32")
    k_pool, v_pool = subjects.array_specs(float32)[3:5]
    assert k_pool == v_pool and k_pool.dtype == "float32" and len(k_pool.shape) == 4
    assert xla.donate(float32) == (3, 4)


def test_its_measured_arrays_run_on_the_xla_backend_through_the_build() -> None:
    import jax.numpy as jnp

    from pallas_flash_bench.runs import measure

    arrays = measure.random_arrays(subjects.array_specs(STEP), STEP)
    assert arrays[5].tolist() == [0, 1, 2, 3, 9, 15] and arrays[6].tolist() == [5, 17, 40, 16, 16]
    out, cache = subjects.backend_subjects(["xla"])[0].build(STEP, None)(*arrays)
    want, _ = pf.ragged_attention(*arrays[:4], None, *arrays[4:], backend="xla")
    assert out.shape == (15, 4, 8) and jnp.allclose(out, want)
    assert cache.k.shape == arrays[3].shape


def test_a_fusion_writes_a_donated_pool_in_place_only_with_no_room_for_a_copy() -> None:
    """`row_figures.in_place_writes`: a fusion of a donated argument's shape, larger than the
    program's temporaries, updates it in place; a plain copy of it, a fusion of another shape
    (the pool flattened) or one the temporaries could hold are copies."""
    pool = "bf16[2257,8,128,128]{3,2,1,0:T(8,128)(2,1)}"
    scatter = {"name": "scatter_fusion", "opcode": "fusion", "shape": pool, "bytes": 591659008}
    copy = dict(scatter, name="copy.22", opcode="copy")
    flat = dict(scatter, name="scatter_fusion.1", shape="bf16[288896,8,128]{2,1,0:T(8,128)(2,1)}")
    copies = [scatter, copy, flat]
    donated = [(2257, 8, 128, 128), (2257, 8, 128, 128)]
    assert row_figures.in_place_writes(copies, donated, temp_bytes=0) == [scatter]
    assert row_figures.in_place_writes(copies, donated, temp_bytes=scatter["bytes"]) == []
    assert row_figures.in_place_writes(copies, [], temp_bytes=0) == []


def test_the_serving_sweep_with_ops_ragged_is_the_mixed_steps() -> None:
    """``pallas-flash bench --serving --ops ragged``: the committed serving page's run, the
    mixed steps, the engine's attention on one chip and the engine's steps."""
    from pallas_flash_bench import cli
    from pallas_flash_bench.models.model_workloads import ENGINE

    args = cli._parser().parse_args(["bench", "--serving", "--ops", "ragged", "--quick"])
    assert cli._workloads(args) == ragged_sweep() + cli._engine_attention()
    assert cli._models(args, []) == ENGINE


def test_the_steps_run_is_the_step_matrix_alone() -> None:
    """``pallas-flash bench --steps``: the committed serving-step matrix page's run, no model
    or context rows and no longest-sequence search."""
    from pallas_flash_bench import cli

    args = cli._parser().parse_args(["bench", "--steps"])
    assert cli._workloads(args) == step_sweep()
    assert cli._models(args, []) == [] and cli._context(args, []) == []


def test_the_step_matrix_covers_every_kv_head_share_page_size_and_mix() -> None:
    """The serving-step matrix: Llama-3-8B's heads over 1 to 8 chips (4 query heads a kv
    head), pages of 16, 64 and 128, decode-only, vLLM's 512- and 2048-token steps."""
    steps = step_sweep()
    assert len(steps) == len(set(steps)) == 4 * 3 * 3
    assert {(w.q_heads, w.kv_heads) for w in steps} == {(4, 1), (8, 2), (16, 4), (32, 8)}
    assert {w.page_size for w in steps} == {16, 64, 128}
    decode_only = [w for w in steps if w.prefill is None]
    assert len(decode_only) == 12 and all(w.batch == 128 for w in decode_only)
    prefill_heavy = [w for w in steps if w.prefill == (3, 640)]
    assert len(prefill_heavy) == 12 and all(w.tokens == 2048 for w in prefill_heavy)
    # the whole model's steps on one chip (8 kv heads), vLLM's pages of 16 among them
    whole_model = {serving_step(mix, 32, 8, page) for mix in ("decode", "vllm-512", "vllm-2048")
                   for page in (16, 128)}  # fmt: skip
    assert whole_model <= set(steps)


def test_the_windows_run_is_the_matrix_s_steps_without_and_at_each_window() -> None:
    """``pallas-flash bench --windows``: Mistral-7B's heads over 4 chips, vLLM's pages of 16,
    decode-only and prefill-heavy, without a window (steps of the matrix too) and at windows
    of 4096 and 1024; no model or context rows."""
    from pallas_flash_bench import cli

    steps = window_sweep()
    assert [w.sliding_window for w in steps] == [None, None, 4096, 1024, 4096, 1024]
    whole = {dataclasses.replace(w, sliding_window=None) for w in steps}
    assert whole == {serving_step(mix, 8, 2, 16) for mix in ("decode", "vllm-2048")}
    assert whole <= set(step_sweep())
    args = cli._parser().parse_args(["bench", "--windows"])
    assert cli._workloads(args) == steps
    assert cli._models(args, []) == [] and cli._context(args, []) == []


def test_our_kernels_loops_and_page_write_bytes_on_a_step() -> None:
    # pages of 16 of a packed pool (uint32: chunks of one position): each of the 15 new tokens
    # is one item, its whole chunk (written without a read); one kv block of 64 positions
    # each, masked (none is seen whole by every row), both kv heads in one grid step: (items,
    # blocks seen whole, masked blocks); the page write's 15 items in one group: (groups,
    # reads, patches, writes' waits)
    assert backend_kernels.loop_trips("xla", STEP, "pallas_flash_write_pages.3") == (1, 15, 15, 15)
    # an int8 cache (the engine's, `ModelWorkload.kv_dtype`): K and V in chunks of a page of 16
    # (a 32-row tile is longer), each run of new tokens one item
    int8 = backend_kernels.loop_trips("xla", STEP, "pallas_flash_write_pages.3", cache_dtype="int8")
    assert int8 == (1, 5, 5, 5)
    ragged = "pallas_flash_ragged_paged_attention.1"  # the chunks' call, 4 query heads / kv
    assert backend_kernels.loop_trips("splitkv", STEP, ragged) == (2, 0, 2)
    decoding = "pallas_flash_ragged_paged_attention_decode.2"  # the 3 decodes: one item
    assert backend_kernels.loop_trips("splitkv", STEP, decoding) == (1, 0, 1)
    assert backend_kernels.loop_trips("xla", STEP, ragged) is None
    decode = Workload("decode", 64, batch=2, cache="paged", page_size=16)
    assert backend_kernels.loop_trips("splitkv", decode, "pallas_flash_write_pages") is None
    chunk = 2 * 1 * 8 * 4  # kv heads x positions x head_dim x bytes of a word
    moved = 2 * 15 * chunk  # the packed pool: each token's row read and its chunk written
    new_rows = STEP.tokens * STEP.cache_bytes_per_token
    assert backend_kernels.min_hbm_bytes("xla", STEP) == STEP.min_hbm_bytes + moved - new_rows
    assert backend_kernels.min_hbm_bytes("xla", decode) == decode.min_hbm_bytes
    # splitkv's ragged kernel writes a packed pool's new tokens itself, each read once
    assert backend_kernels.writes_own("splitkv", STEP)
    assert backend_kernels.min_hbm_bytes("splitkv", STEP) == STEP.min_hbm_bytes


def test_a_program_whose_only_kernels_are_cache_writes_keeps_the_compilers_bytes() -> None:
    writes = [{"name": "pallas_flash_write_pages.2"}, {"name": "pallas_flash_write_page_scales"}]
    assert not row_figures.has_estimated_kernels(writes)  # the xla backend's serving step
    ragged = {"name": "pallas_flash_ragged_paged_attention.1"}
    assert row_figures.has_estimated_kernels([*writes, ragged])
