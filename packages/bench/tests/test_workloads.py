"""Flop and byte counts of workloads, and the sweeps."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_flash_bench.kernels.sweeps import LLAMA_1B, default_sweep, quick_sweep
from pallas_flash_bench.kernels.workloads import Workload


def test_forward_flops_are_two_matmuls_and_causal_counts_half() -> None:
    w = Workload("forward", 4096)
    assert w.useful_flops == 4 * 16 * 4096**2 * 128
    assert Workload("forward", 4096, causal=True).useful_flops == w.useful_flops / 2


def test_backward_is_two_and_a_half_forwards() -> None:
    forward = Workload("forward", 2048).useful_flops
    assert Workload("forward_backward", 2048).useful_flops == 3.5 * forward


def test_mla_counts_each_matmul_at_its_own_head_dim() -> None:
    w = Workload("forward_backward", 4096, causal=True, head_dim=192, v_head_dim=128)
    pairs = 16 * 4096**2 / 2
    assert w.useful_flops == pairs * (2 * (192 + 128) + 2 * (3 * 192 + 2 * 128))
    forward = Workload("forward", 1024, head_dim=192, v_head_dim=128)
    assert forward.min_hbm_bytes == 2 * 16 * 1024 * (192 + 128) * 2  # q, k at 192; v, o at 128
    assert w.label == "forward_backward N=4096 causal D=192/128"
    with pytest.raises(ValueError, match="v_head_dim"):
        Workload("decode", 4096, v_head_dim=64)


def test_head_dim_64_rows_name_their_head_dim() -> None:
    w = Workload("forward", 4096, causal=True, **LLAMA_1B)
    assert w.label == "forward N=4096 causal H32/8 D=64"
    assert w.min_hbm_bytes == 2 * (32 + 8) * 4096 * 64 * 2  # q and o of 32 heads, k and v of 8
    assert w in default_sweep()


def test_a_bias_is_an_input_of_each_pass() -> None:
    forward = Workload("forward", 1024, bias=True)
    bias = 16 * 1024 * 1024 * 2  # [1, heads, N, N] bfloat16
    assert forward.min_hbm_bytes == 4 * 16 * 1024 * 128 * 2 + bias
    both = Workload("forward_backward", 1024, bias=True)
    assert both.min_hbm_bytes == 3 * forward.min_hbm_bytes
    causal = Workload("forward", 1024, causal=True, bias=True)
    assert causal.min_hbm_bytes == forward.min_hbm_bytes - bias / 2  # its visible half
    assert both.useful_flops == Workload("forward_backward", 1024).useful_flops
    assert causal.label == "forward N=1024 causal bias"
    with pytest.raises(ValueError, match="bias"):
        Workload("decode", 4096, bias=True)


def test_decode_bytes_are_the_cache() -> None:
    w = Workload("decode", 131072, q_heads=32, kv_heads=8)
    cache = 2 * 8 * 131072 * 128 * 2
    assert w.min_hbm_bytes == cache + 2 * 32 * 128 * 2
    assert w.tokens == 1


def test_forward_bytes_are_q_k_v_and_o() -> None:
    w = Workload("forward", 1024)
    assert w.min_hbm_bytes == 4 * 16 * 1024 * 128 * 2


def test_labels_are_unique_in_the_default_sweep() -> None:
    labels = [w.label for w in default_sweep()]
    assert len(labels) == len(set(labels))
    assert {w.seq_len for w in default_sweep() if w.op == "forward_backward"} == {
        1024,
        2048,
        4096,
        8192,
        16384,
        32768,
    }
    forward = {w.seq_len for w in default_sweep() if w.op == "forward"}
    assert {1536, 3072, 5120, 6144, 12288, 24576, 100_000} < forward, "lengths off the powers"
    assert max(w.seq_len for w in default_sweep() if w.op == "decode") == 131072


def test_quick_sweep_is_a_small_subset_of_the_default() -> None:
    assert len(quick_sweep()) < len(default_sweep()) / 4
    assert set(quick_sweep()) <= set(default_sweep())


def test_only_decode_runs_on_several_chips() -> None:
    assert Workload("decode", 8192, chips=4).label == "decode L=8192 on 4 chips"
    with pytest.raises(ValueError, match="chips"):
        Workload("forward", 8192, chips=4)
    with pytest.raises(ValueError, match="chips"):
        Workload("decode", 8192, chips=0)


def test_a_slice_adds_decoding_over_all_its_chips() -> None:
    assert {w.chips for w in default_sweep()} == {1}
    over_four = [w for w in default_sweep(4) if w.chips == 4]
    assert {(w.seq_len, w.q_heads) for w in over_four} == {
        (n, q) for n in (8192, 32768, 131072) for q in (16, 32)
    }
    quick = [w for w in quick_sweep(4) if w.op == "decode" and w.seq_len == 131072]
    assert sorted(w.chips for w in quick) == [1, 4]
    assert set(quick_sweep(4)) <= set(default_sweep(4))


def test_ragged_serving_workloads_count_their_cached_tokens() -> None:
    w = Workload("decode", 8192, batch=4, q_heads=32, kv_heads=8, lengths=(512, 8192))
    lengths = w.sequence_lengths
    assert len(lengths) == 4 and ((lengths >= 512) & (lengths <= 8192)).all()
    np.testing.assert_array_equal(lengths, w.sequence_lengths)  # the seed is fixed
    assert w.min_hbm_bytes == 2 * 4 * 32 * 128 * 2 + 2 * 8 * 128 * 2 * lengths.sum()
    int8 = Workload("decode", 8192, batch=4, q_heads=32, kv_heads=8, lengths=(512, 8192),
                    cache_dtype="int8")  # fmt: skip
    assert int8.cache_bytes_per_token == 2 * 8 * (128 + 4)  # values and two float32 scales
    # blocks of 2048 positions: a sequence of n tokens holds ceil(n / 2048) of its 4
    assert w.active_fraction(4) == sum(-(-n // 2048) for n in lengths) / 16
    paged = Workload("decode", 8192, batch=4, lengths=(512, 8192), cache="paged")
    assert paged.num_pages == sum(-(-n // 128) for n in lengths)
    # 16 blocks of the 64 pages a sequence may hold: 4 pages a block
    assert paged.active_fraction(16) == sum(-(-n // 512) for n in lengths) / (4 * 16)
    assert "B=4 lengths 512..8192 paged/128" in paged.label


def test_a_ragged_slice_is_as_slow_as_its_busiest_chip() -> None:
    full = Workload("decode", 131072, batch=8, chips=4)
    assert full.busiest_chip_share == 0.25
    ragged = Workload("decode", 131072, batch=8, lengths=(32768, 131072), chips=4)
    lengths = ragged.sequence_lengths
    assert ragged.busiest_chip_share == np.minimum(lengths, 32768).sum() / lengths.sum()


def test_a_paged_slice_spreads_each_sequence_round_its_chips() -> None:
    w = Workload("decode", 131072, batch=8, lengths=(32768, 131072), cache="paged", chips=4)
    lengths = w.sequence_lengths
    tokens = w.chip_tokens()
    np.testing.assert_array_equal(tokens.sum(axis=0), lengths)  # every token on one chip
    assert (tokens.max(axis=0) - tokens.min(axis=0) <= 128).all()  # at most a page apart
    assert 0.25 <= w.busiest_chip_share < 0.2503  # near 1 / 4: each chip every 4th page
    assert w.num_pages % 4 == 0 and w.num_pages >= sum(-(-n // 128) for n in lengths)
    mine = sum(
        1
        for b, n in enumerate(lengths)
        for j in range(-(-n // 128))
        if (j + b) % 4 == w.busiest_chip
    )
    assert w.active_fraction(1024) == mine / (8 * 1024)
    # no chip holds more than its quarter of a sequence's table: splitkv's second pass idles
    assert not w.runs_conditional_kernels
    assert Workload(
        "decode", 131072, batch=8, lengths=(32768, 131072), chips=4
    ).runs_conditional_kernels


def test_serving_fields_are_for_decode_only() -> None:
    with pytest.raises(ValueError, match="decode only"):
        Workload("forward", 1024, cache_dtype="int8")
    with pytest.raises(ValueError, match="lengths"):
        Workload("decode", 1024, lengths=(10, 2048))
