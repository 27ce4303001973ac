"""tpu-inference's Ragged Paged Attention v3 as a decode reference: its own layout, its block
search, the note when it is missing, and its data-dependent loops charged by their trip
counts (`loop_trips`), its mixed kernel none on a decode batch."""

from __future__ import annotations

import importlib.util

import pytest

from pallas_flash_bench.kernels import references, rpa_reference
from pallas_flash_bench.kernels.sweeps import SERVING_LENGTHS
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.aot.devices import libtpu_version

needs_rpa = pytest.mark.skipif(
    libtpu_version() is None or references._rpa_unavailable() is not None,
    reason="libtpu or tpu-inference is not installed",
)

SERVING = dict(q_heads=32, kv_heads=8, lengths=SERVING_LENGTHS, cache="paged")
BLOCKS = rpa_reference.DecodeBlocks(1024, 512)


def test_it_gets_its_own_layout_k_and_v_interleaved_in_packed_words() -> None:
    w = Workload("decode", 8192, batch=32, **SERVING)
    q, k, v, cache, lengths, table = rpa_reference.arguments(w)
    assert q == ((32, 32, 128), "bfloat16", None)
    assert k == v == ((32, 8, 128), "bfloat16", None)  # the new token of each sequence
    assert cache == ((w.num_pages, 128, 8, 2, 128), "bfloat16", None)  # 16 heads, 2 a word
    assert lengths == ((32,), "int32", None) and table == ((32 * 64,), "int32", None)
    one = Workload("decode", 32768, q_heads=32, kv_heads=32)  # its pages of 128, in order
    assert [s.shape for s in rpa_reference.arguments(one)] == [
        (1, 32, 128),
        (1, 32, 128),
        (1, 32, 128),
        (256, 128, 32, 2, 128),
        (1,),
    ]


def test_it_is_built_for_floating_point_decode_on_one_chip_paged_or_one_sequence() -> None:
    applies = rpa_reference.applies
    assert applies(BLOCKS, Workload("decode", 8192, batch=32, **SERVING))
    assert applies(BLOCKS, Workload("decode", 32768, q_heads=32, kv_heads=8))
    assert not applies(BLOCKS, Workload("decode", 8192, batch=32, cache_dtype="int8", **SERVING))
    contiguous = dict(SERVING, cache="contiguous")
    assert not applies(BLOCKS, Workload("decode", 8192, batch=32, **contiguous))
    assert not applies(BLOCKS, Workload("decode", 32768, chips=4))
    assert not applies(BLOCKS, Workload("forward", 4096))
    # a block longer than a sequence repeats a shorter configuration
    assert not applies(rpa_reference.DecodeBlocks(4096, 4096), Workload("decode", 2048))
    # the mixed kernel's blocks: vLLM's heuristic, the query compute block dividing the block
    assert rpa_reference.mixed_blocks(Workload("decode", 8192, batch=32, **SERVING)) == (
        16,
        1024,
        16,
        512,
    )


def test_its_block_search_is_a_few_kv_blocks_and_compute_chunks() -> None:
    quick, default = rpa_reference.BLOCKS["quick"], rpa_reference.BLOCKS["default"]
    assert set(quick) <= set(default) and len(default) >= 3 * len(quick)
    assert rpa_reference.DecodeBlocks(4096, 4096) in default  # vLLM's own choice at 8 kv heads
    for blocks in default:
        assert blocks.kv % blocks.kv_compute == 0 and blocks.kv_compute % 128 == 0
    assert rpa_reference.DecodeBlocks(2048, 512).label == "kv blocks 2048, compute 512"
    assert rpa_reference.DecodeBlocks(1024, 1024).label == "kv blocks 1024"


def test_without_tpu_inference_the_report_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tpu_inference" else find_spec(name, *a),
    )
    assert "tpu-inference-rpa-v3" not in {s.name for s in references.reference_subjects("quick")}
    note = references.reference_notes()[2]
    assert note == (
        "tpu-inference-rpa-v3 is not compared: tpu-inference is not installed: "
        "pip install --no-deps tpu-inference==0.24.0 (==0.32.0 on jax 0.12)"
    )
    with pytest.raises(ModuleNotFoundError):
        rpa_reference.load_kernel()


def test_its_loops_run_once_per_sequence_kv_block_and_compute_chunk() -> None:
    # lengths 512, 1024, 1536, 2048: kv blocks of 1024 1 + 1 + 2 + 2, chunks of 512 1 + 2 + 3 + 4
    w = Workload("decode", 2048, batch=4, even_lengths=True, **dict(SERVING, lengths=(512, 2048)))
    assert list(w.sequence_lengths) == [512, 1024, 1536, 2048]
    trips = rpa_reference.loop_trips
    assert trips(BLOCKS, w, "RPAd-p_128-bq_1_1-bkv_1024_512.1") == (4, 6, 10)
    whole = rpa_reference.DecodeBlocks(2048, 2048)
    assert trips(whole, w, "RPAd-p_128-bq_1_1-bkv_2048_2048.1") == (4, 4, 4)
    # the mixed kernel runs no sequence of a decode batch: none of its four loops
    assert trips(BLOCKS, w, "RPAm-p_128-bq_2_2-bkv_1024_512.1") == (0, 0, 0, 0)
    assert trips(BLOCKS, w, "fusion.3") is None


@needs_rpa
def test_it_compiles_for_v5e_and_charges_its_decode_kernel_only(run_row) -> None:
    w = Workload("decode", 2048, batch=4, **dict(SERVING, lengths=(512, 2048)))
    kernel = rpa_reference.load_kernel()
    assert rpa_reference.cache_shape(w) == kernel.get_kv_cache_shape(
        w.num_pages, 128, 8, 128, "bfloat16"
    )
    (subject,) = [
        s
        for s in references.reference_subjects("quick")
        if s.name.startswith("tpu-") and not s.config.startswith("step")
    ]
    row = run_row(subject, w)
    assert row["compiled"], row["error"]
    decode, mixed = row["kernels"]
    assert decode["name"].startswith("RPAd-") and mixed["name"].startswith("RPAm-")
    for k in (decode, mixed):  # every loop charged its runs, none a lower bound
        assert k["cycles_from"].startswith("loops whose trip counts read memory"), k
    assert "(0, 0, 0, 0 runs" in mixed["cycles_from"]
    assert mixed["cycles"] < 100 and decode["cycles"] > 50 * mixed["cycles"]
    assert row["other_ops"]["cycles"] < decode["cycles"]  # the cache is donated, not copied
    assert not any("LOWER bound" in n for n in row["notes"])
