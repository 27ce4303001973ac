"""jax's ragged_paged_attention as a decode reference: its own layout, the workloads it takes,
and its data-dependent loops charged by their trip counts (`loop_trips`)."""

from __future__ import annotations

import math

import pytest

from pallas_flash_bench import aot
from pallas_flash_bench.kernels import ragged_reference
from pallas_flash_bench.kernels.references import reference_subjects
from pallas_flash_bench.kernels.sweeps import SERVING_LENGTHS
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.aot.devices import libtpu_version
from pallas_flash_estimate.cost import dma, llo, spread
from pallas_flash_estimate.evaluate import bundle_listing, loop_trips

needs_libtpu = pytest.mark.skipif(libtpu_version() is None, reason="libtpu is not installed")

SERVING = dict(q_heads=32, kv_heads=8, lengths=SERVING_LENGTHS, cache="paged")
BLOCKS = ragged_reference.RaggedBlocks(16, 8)


def _subject(sweep: str = "quick"):
    (subject,) = [s for s in reference_subjects(sweep) if s.name == "jax-ragged-paged"]
    return subject


def test_it_gets_its_own_layout_k_and_v_interleaved_and_no_scale_arrays() -> None:
    w = Workload("decode", 8192, batch=32, cache_dtype="int8", **SERVING)
    q, pool, lengths, table = ragged_reference.arguments(w)
    assert q == ((32, 32, 128), "bfloat16", None)
    assert pool == ((w.num_pages, 128, 16, 128), "int8", None)
    assert lengths == ((32,), "int32", None) and table == ((32, 64), "int32", None)
    one = Workload("decode", 32768, q_heads=32, kv_heads=8)
    assert [s.shape for s in ragged_reference.arguments(one)] == [
        (1, 32, 128),
        (256, 128, 16, 128),
        (1,),
    ]


def test_it_is_built_for_decode_on_one_chip_paged_or_one_sequence() -> None:
    subject = _subject()
    assert subject.config == "8 pages x 2 queries" and subject.whole_vmem
    assert subject.build(Workload("decode", 8192, batch=32, **SERVING), None) is not None
    assert subject.build(Workload("decode", 32768, q_heads=32, kv_heads=8), None) is not None
    contiguous = dict(SERVING, cache="contiguous")
    assert subject.build(Workload("decode", 8192, batch=32, **contiguous), None) is None
    assert subject.build(Workload("forward", 4096), None) is None
    assert subject.build(Workload("decode", 32768, chips=4), None) is None
    # blocks longer than a sequence's pages, or more queries than the batch, repeat others
    assert not ragged_reference.applies(
        ragged_reference.RaggedBlocks(32, 8), Workload("decode", 2048)
    )
    wide = ragged_reference.RaggedBlocks(16, 4)
    assert not ragged_reference.applies(wide, Workload("decode", 32768))
    assert ragged_reference.applies(wide, Workload("decode", 8192, batch=32, **SERVING))
    # the fewest queries of its sweep, clamped to one sequence
    assert ragged_reference.applies(ragged_reference.RaggedBlocks(8, 2), Workload("decode", 32768))


def test_its_int8_rows_count_no_scale_bytes() -> None:
    w = Workload("decode", 8192, batch=32, cache_dtype="int8", **SERVING)
    tokens = float(w.sequence_lengths.sum())
    assert ragged_reference.min_hbm_bytes(w) == w.min_hbm_bytes - 2 * 8 * 4 * tokens
    bf16 = Workload("decode", 8192, batch=32, **SERVING)
    assert ragged_reference.min_hbm_bytes(bf16) == bf16.min_hbm_bytes
    assert any("per tensor" in n for n in ragged_reference.notes(w))


def test_its_loops_run_once_per_sequence_and_per_kv_block_of_each_head_block() -> None:
    w = Workload("decode", 8192, batch=32, **SERVING)
    kv = sum(math.ceil(int(n) / 2048) for n in w.sequence_lengths)
    assert ragged_reference.head_blocks(w) == 1  # 8 kv heads in bf16 fill its tiling
    assert ragged_reference.loop_trips(BLOCKS, w, "ragged_paged_attention_kernel.1") == (32, kv)
    assert ragged_reference.loop_trips(BLOCKS, w, "fusion.3") is None
    wide = Workload("decode", 8192, batch=32, **dict(SERVING, kv_heads=32))
    assert ragged_reference.head_blocks(wide) == 4  # 8 of its 32 kv heads per step
    assert ragged_reference.loop_trips(BLOCKS, wide, "ragged_paged_attention_kernel.1") == (
        4 * 32,
        4 * kv,
    )
    one = Workload("decode", 131072, q_heads=32, kv_heads=8)
    assert ragged_reference.loop_trips(BLOCKS, one, "ragged_paged_attention_kernel.1") == (1, 64)


def _nd(index: int, depth: int) -> str:
    return f"0x{index:x} : {'>' * depth} {{}}"


# A grid loop of 3 iterations (its first one prefetches: a region run once) around a loop
# whose trip count is read from SMEM (%s20) around another such loop, as jax's ragged paged
# attention compiles: the sequences of a query block and each one's kv blocks.
NESTED = "\n".join(
    [
        "= control target key start",
        "LB: loop body",
        "PF: predicated region fallthrough",
        "= control target key end",
        "",
        "  0 :  { %s1 = smov 0 }",
        "0x1 LB: > { %s2 = sphi %s1, %s3 } /* Start region 7 */",
        "0x2 : > { %s3 = sadd.s32 1, %s2  ;;  %s20 = sld [smem:[#allocation1]]  ;;  "
        "%p30 = scmp.ne.s32.totalorder %s2, 0 }",
        "0x3 : > { %31 = sbr.rel (%p30) target = $region10 }",
        *(_nd(i, 1) for i in range(4, 8)),
        "0x8 : > { %32 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s1, /*size_in_granules=*/4, "
        "/*vmem=*/%s1, /*dst_syncflagno=*/%s1 }",
        "0x9 PF: > { %s33 = smov 0 } /* Start region 10 */",
        "0xa LB: >> { %s4 = sphi %s1, %s5 } /* Start region 8 */",
        "0xb : >> { %s5 = sadd.s32 1, %s4 }",
        "0xc LB: >>> { %s6 = sphi %s1, %s7 } /* Start region 9 */",
        "0xd : >>> { %s7 = sadd.s32 1, %s6  ;;  %9 = vmatmul.bf16.gmra.mxu0 %v1 }",
        "0xe : >>> { %p8 = scmp.lt.s32.totalorder %s7, %s20  ;;  %40 = dma.hbm_to_vmem "
        "[thread:$0]  /*hbm=*/%s1, /*size_in_granules=*/2, /*vmem=*/%s1, /*dst_syncflagno=*/%s1 }",
        "0xf : >>> { %10 = sbr.rel (%p8) target = $region9 }",
        *(_nd(i, 3) for i in range(0x10, 0x14)),
        "0x14 : >> { %p11 = scmp.lt.s32.totalorder %s5, %s20 }",
        "0x15 : >> { %12 = sbr.rel (%p11) target = $region8 }",
        *(_nd(i, 2) for i in range(0x16, 0x1A)),
        "0x1a : > { %p13 = scmp.lt.s32.totalorder %s3, 3 }",
        "0x1b : > { %14 = sbr.rel (%p13) target = $region7 }",
        *(_nd(i, 1) for i in range(0x1C, 0x20)),
        "0x20 :  {} /* exit bundle: %k.1 = custom-call(%a) */",
        "",
    ]
)


def test_loops_without_a_trip_count_are_weighed_by_the_runs_given() -> None:
    listing = bundle_listing.parse_bundles(NESTED, "k.1")
    assert [(lp.start, lp.depth, lp.trip_count) for lp in listing.loops] == [
        (1, 1, 3),
        (10, 2, None),
        (12, 3, None),
    ]
    assert llo.build_schedule(listing).executed_bundles_min is None  # counted once otherwise
    counts = loop_trips.bundle_counts(listing, (5, 12))
    assert not isinstance(counts, str)
    lo, hi = counts
    assert lo == hi
    # before the grid loop and after it: once; the grid loop's 8 bundles 3 times, but its
    # first-iteration region once; the middle loop's 8 bundles 5 times; the inner one's 8, 12
    assert hi[0] == hi[32] == 1 and hi[8] == 1 and hi[2] == 3 and hi[11] == 5 and hi[13] == 12
    assert loop_trips.weigh(counts, list(range(34))) == (181, 181)
    assert 1 + 3 * 8 + 1 + 5 * 8 + 12 * 8 + 3 * 6 + 1 == 181
    # the vmatmul on mxu0 (16 cycles) runs with every inner iteration
    assert loop_trips.busiest(counts, list(listing.mxu_prefixes.values())) == (192, 192)
    # the prefetch (4 granules of 32 bytes) once, the inner loop's copy (2) 12 times
    assert dma.executed_bytes(listing, counts) == (4 * 32 + 12 * 2 * 32,) * 2
    assert dma.executed_bytes(listing) is None  # without the runs: not known


def test_the_runs_must_match_the_loops_without_a_trip_count() -> None:
    listing = bundle_listing.parse_bundles(NESTED, "k.1")
    assert isinstance(loop_trips.bundle_counts(listing, (5,)), str)
    schedule = llo.build_schedule(listing)
    w = Workload("decode", 8192)
    entry = spread.kernel_entry(schedule, w, (5,))
    assert not entry["cycles_from"].startswith("loops whose")  # the lower bound, with a warning
    assert "loop trip counts not applied" in entry["warnings"][-1]
    charged = spread.kernel_entry(schedule, w, (5, 12))
    assert charged["cycles"] == 192 and charged["cycles_from"].startswith("loops whose")
    assert charged["estimates"]["schedule"] == 181 and charged["estimates"]["mxu"] == 192
    assert charged["dma_bytes"] == 4 * 32 + 12 * 2 * 32


@needs_libtpu
def test_it_compiles_for_v5e_in_its_own_layout() -> None:
    from pallas_flash_estimate.targets import TARGETS

    w = Workload("decode", 2048, batch=8, **dict(SERVING, lengths=(512, 2048)))
    blocks = ragged_reference.RaggedBlocks(8, 8)
    compiled = aot.compile_for(
        ragged_reference.build(blocks, w), ragged_reference.arguments(w), TARGETS["v5e-1"]
    )
    assert "ragged_paged_attention_kernel" in compiled.as_text()
