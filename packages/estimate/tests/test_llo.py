"""Tests of the LLO dump parser on trimmed real dumps (tests/samples/llo) and, when present, on
the full dumps under /tmp/llo_samples."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from pallas_flash_estimate.cost import llo
from pallas_flash_estimate.evaluate import bundle_listing, bundle_weights, scalar_defs, scalar_flow
from pallas_flash_estimate.read import bundles, dump_files

SAMPLES = Path(__file__).parent / "samples" / "llo"
FLASH = SAMPLES / "flash_causal"
FLASH_BUNDLES = FLASH / "1795237185551748033-flash_attention.1-72-final_bundles.txt"
FLASH_UTIL = (
    FLASH / "1795237185551748033-flash_attention.1-70-final_hlo-static-per-bundle-utilization.txt"
)
FLASH_ANALYSIS = (
    FLASH / "1795237185551748033-flash_attention.1-71-schedule-analysis_final_bundles.txt"
)
SPLASH = SAMPLES / "splash_fwd_and_copy"

UNITS = (
    "MXU",
    "XLU",
    "VALU",
    "VPOP",
    "EUP",
    "VLOAD",
    "VLOAD:FILL",
    "VSTORE",
    "VSTORE:SPILL",
    "SALU",
)


@pytest.fixture(scope="module")
def flash() -> llo.KernelSchedule:
    return llo.load_kernel(FLASH_BUNDLES, FLASH_UTIL)


@pytest.fixture(scope="module")
def splash_dump() -> dict[str, llo.KernelSchedule]:
    return llo.load_dump(SPLASH)


# --------------------------------------------------------------------------------------------
# Bundle listing


def test_bundles_markers_depth_and_multiline_comments():
    listing = bundle_listing.parse_bundles(FLASH_BUNDLES.read_text(), "flash_attention.1")
    b = listing.bundles
    assert len(b) == 80
    assert [x.address for x in b] == list(range(80))
    assert [x.index for x in b if x.markers] == [5, 33, 57, 65, 67]
    assert b[5].markers == ("LB",) and all(b[i].markers == ("PF",) for i in (33, 57, 65, 67))
    # '>' marks non-control bundles of the loop; empty and back-edge bundles print none
    assert b[5].nest == 1 and b[0].nest == 0
    assert b[76].empty and b[76].nest == 0
    assert b[74].branch() == ("!%p16605_p11", 113) and b[74].nest == 0
    # a DMA descriptor spans ten lines: one bundle, its comment kept in the text
    dma = b[18]
    assert dma.instructions[0].opcode == "dma.hbm_to_vmem"
    assert dma.instructions[0].note.endswith("second_minor_factor: 1")
    assert "iteration_bounds: (1, 4, 4, 4)" in dma.text
    assert listing.grid == (1, 4, 4, 4)
    assert listing.hlo == "%flash_attention.1 = custom-call(%q.1, %k.1, %v.1)"
    assert listing.hlo_opcode == "custom-call"
    assert listing.warnings == ()


def test_instruction_forms():
    listing = bundle_listing.parse_bundles(FLASH_BUNDLES.read_text(), "flash_attention.1")
    ins = {i.dest: i for x in listing.bundles for i in x.instructions if i.dest}
    # predicated instruction: the guard is split from the operands
    assert ins["%s9711_s1"].guard == "!%p9652_p4"
    assert ins["%s9711_s1"].args == "1, %s9441_s16"
    # conditional move keeps its (predicate, old value) operand
    assert ins["%s18591_s25"].opcode == "smov" and ins["%s18591_s25"].guard is None
    assert ins["%s18591_s25"].args == "(%p38_p0, %s37_s25), 0"
    assert ins["%s9473_s24"].note.startswith("phi copy :: iteration index, stage = 0")
    assert ins["%p16605_p11"].note == "loop exit test"


def test_flash_loop_regions_and_trip_count(flash):
    (loop,) = flash.loops
    assert (loop.start, loop.end, loop.branch, loop.depth) == (5, 78, 74, 1)
    assert loop.bundles == 74 and flash.grid_loop == loop
    # 64 grid steps + the pipeline's fill and drain iterations
    assert loop.trip_count == 66 == flash.grid_steps + 2 == flash.trip_count
    spans = [
        (r.branch, r.start, r.end, r.level, r.guard, r.executed_iterations) for r in loop.regions
    ]
    assert spans == [
        (19, 24, 66, 0, True, 64),  # pipeline guard: compute runs in the 64 grid steps
        (26, 31, 32, 1, False, 16),  # accumulator init: first kv block of each (head, q block)
        (38, 43, 56, 1, False, 40),  # causal skip: kv block <= q block, 10 of 16 per head
        (58, 63, 64, 1, False, 16),  # write-back: last kv block
    ]
    assert loop.regions[0].predicate == "%p9652_p4"
    assert loop.guarded_bundles == 43
    assert loop.predicated_bundles == 2 + 14 + 2 == flash.predicated_bundles
    # 66 x 74 minus what the skipped regions spare
    assert loop.executed_bundles == 66 * 74 - 2 * 43 - 48 * 2 - 24 * 14 - 48 * 2 == 4270
    assert flash.executed_bundles == 4270 + (80 - 74)


def test_grid_not_fitting_the_loop_leaves_grid_predicates_undecided():
    text = FLASH_BUNDLES.read_text().replace(
        "iteration_bounds: (1, 4, 4, 4)", "iteration_bounds: (1, 4, 4, 8)"
    )
    (loop,) = bundle_listing.parse_bundles(text, "flash_attention.1").loops
    # 128 grid steps cannot run in 66 iterations: grid indices are not trusted
    assert [r.executed_iterations for r in loop.regions] == [64, None, None, None]
    assert loop.executed_bundles is None
    assert loop.executed_bundles_max == 66 * 74 - 2 * 43
    assert loop.executed_bundles_min == 66 * 74 - 2 * 43 - 64 * 18


def test_flash_counts_and_utilization(flash):
    assert flash.name == "flash_attention.1"
    assert flash.bundles == 80 and flash.bundles_per_step == 74
    assert flash.units == UNITS
    assert flash.capacity == dict(zip(UNITS, (4, 3, 4, 2, 1, 3, 3, 1, 1, 2), strict=True))
    assert flash.used == dict(zip(UNITS, (38, 3, 19, 1, 1, 12, 3, 9, 6, 64), strict=True))
    assert flash.utilization("MXU") == pytest.approx(38 / (4 * 74))
    assert flash.utilization("SALU") == pytest.approx(64 / (2 * 74))
    assert flash.mxu_ops == 10 and flash.opcodes["vmatmul"] == 10
    assert (flash.spill_stores, flash.fill_loads) == (6, 3)
    assert (flash.scalar_spill_stores, flash.scalar_fill_loads) == (8, 9)
    assert flash.warnings == ()
    assert flash.hlo_opcode == "custom-call" and flash.custom_call_target is None
    assert llo.is_pallas_kernel(flash)  # from the exit bundle comment


def test_schedule_analysis_and_bundle_count_check():
    analysis = dump_files.parse_schedule_analysis(FLASH_ANALYSIS.read_text())
    assert (analysis.total, analysis.empty) == (1669, 15)
    assert analysis.custom_call_target == "tpu_custom_call"
    sched = llo.load_kernel(FLASH_BUNDLES, FLASH_UTIL, FLASH_ANALYSIS)
    assert sched.custom_call_target == "tpu_custom_call" and llo.is_pallas_kernel(sched)
    # the sample is an excerpt of the 1669-bundle schedule: the mismatch is reported, not raised
    assert sched.warnings == ("schedule analysis reports 1669 bundles, parsed 80",)


def test_utilization_rows_mismatch_and_unit_header(tmp_path):
    text = FLASH_UTIL.read_text().rstrip("\n").split("\n")
    short = tmp_path / "util.txt"
    short.write_text("\n".join(text[:-1]) + "\n")
    sched = llo.load_kernel(FLASH_BUNDLES, short)
    assert sched.warnings == ("utilization has 79 rows for 80 bundles",)
    assert sched.used["MXU"] == 38
    other = dump_files.parse_utilization(
        "== CAPACTIY:\nMXU, VPU\n 2 8\n== UTILIZATION:\n1 8\n0 3\n"
    )
    assert other.units == ("MXU", "VPU") and other.capacity == {"MXU": 2, "VPU": 8}
    assert other.summed() == {"MXU": 1, "VPU": 11}
    with pytest.raises(ValueError):
        dump_files.parse_utilization("not a utilization file")


def test_without_utilization_file():
    sched = llo.load_kernel(FLASH_BUNDLES)
    assert sched.units == () and sched.used == {}
    assert sched.warnings == ("no utilization file",)
    assert sched.bundles_per_step == 74


# --------------------------------------------------------------------------------------------
# Dump folders


def test_splash_kernel_with_data_dependent_region(splash_dump):
    assert sorted(splash_dump) == ["copy", "splash_mha_fwd_residuals.1"]
    fwd = splash_dump["splash_mha_fwd_residuals.1"]
    assert llo.is_pallas_kernel(fwd) and fwd.custom_call_target == "tpu_custom_call"
    assert fwd.grid == (4, 4, 4) and fwd.trip_count == 66
    (loop,) = fwd.loops
    assert (loop.start, loop.end, loop.bundles) == (5, 83, 79)
    ran = [(r.start, r.end, r.guard, r.executed_iterations) for r in loop.regions]
    # the block-mask skip reads splash's mask tables from memory: undecidable statically
    assert ran == [
        (26, 71, True, 64),
        (34, 35, False, 16),
        (55, 60, False, None),
        (68, 69, False, 16),
    ]
    assert loop.predicated_bundles == 10
    assert loop.executed_bundles_max == 66 * 79 - 2 * 46 - 48 * 2 - 48 * 2 == 4930
    assert loop.executed_bundles_min == 4930 - 64 * 6
    assert loop.executed_bundles is None
    assert (fwd.executed_bundles_min, fwd.executed_bundles_max) == (4546 + 6, 4930 + 6)
    assert fwd.mxu_ops == 2 and (fwd.spill_stores, fwd.fill_loads) == (2, 1)
    assert fwd.warnings == ("schedule analysis reports 2110 bundles, parsed 85",)


def test_xla_copy_with_nested_loops(splash_dump):
    copy = splash_dump["copy"]
    assert not llo.is_pallas_kernel(copy)
    assert copy.hlo_opcode == "copy" and copy.custom_call_target is None
    assert copy.grid is None and copy.mxu_ops == 0
    loops = [(lp.start, lp.end, lp.depth, lp.trip_count) for lp in copy.loops]
    assert loops == [
        (2, 112, 1, 5),
        (19, 27, 2, None),
        (33, 39, 2, None),
        (72, 78, 2, None),
        (89, 95, 2, None),
    ]
    listing = bundle_listing.parse_bundles(
        (SPLASH / "1795237188305336597-copy-66-final_bundles.txt").read_text(), "copy"
    )
    assert [listing.bundles[lp.start].nest for lp in listing.loops] == [1, 2, 2, 2, 2]
    assert copy.grid_loop.start == 2 and copy.bundles_per_step == 111
    assert [r.level for r in copy.grid_loop.regions] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4, 2]
    assert copy.grid_loop.guarded_bundles == 30 + 58
    assert copy.predicated_bundles == 21 + 49
    # inner loops run a data-dependent number of times: no executed-bundle total
    assert copy.executed_bundles_min is None and copy.executed_bundles is None


def test_load_dump_skips_wrappers_and_keys_twins(tmp_path):
    for p in FLASH.iterdir():
        shutil.copy(p, tmp_path / p.name)
    for wrapper in ("1-<late-finalization>-68", "1-<late-initialization>-71", "1-TLP-73"):
        shutil.copy(FLASH_BUNDLES, tmp_path / f"{wrapper}-final_bundles.txt")
    shutil.copy(FLASH_BUNDLES, tmp_path / "99-flash_attention.1-72-final_bundles.txt")
    files = dump_files.find_dump_files(tmp_path)
    assert sorted(files) == ["flash_attention.1", "flash_attention.1@99"]
    assert sorted(files["flash_attention.1"]) == ["analysis", "bundles", "utilization"]
    assert sorted(files["flash_attention.1@99"]) == ["bundles"]
    dump = llo.load_dump(tmp_path)
    assert dump["flash_attention.1"].name == dump["flash_attention.1@99"].name
    assert "dumped by several programs" in dump["flash_attention.1"].warnings[-1]
    assert dump["flash_attention.1@99"].warnings[0] == "no utilization file"


def test_missing_files_raise_with_the_path(tmp_path):
    missing = tmp_path / "nope-final_bundles.txt"
    with pytest.raises(FileNotFoundError, match=re.escape("nope-final_bundles.txt")):
        llo.load_kernel(missing)
    with pytest.raises(FileNotFoundError, match=re.escape("util.txt")):
        llo.load_kernel(FLASH_BUNDLES, tmp_path / "util.txt")
    with pytest.raises(FileNotFoundError, match="dump folder not found"):
        llo.load_dump(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape("no *-final_bundles.txt")):
        llo.load_dump(tmp_path / "empty")


# --------------------------------------------------------------------------------------------
# Semantics on a minimal hand-written listing

TINY = """\
= control target key start
LB: loop body
PF: predicated region fallthrough
= control target key end

  0 :  { %s1 = smov 0 /* copy for cssa */ }
0x1 LB: > { %s2 = sphi %s1, %s3 /* iteration index, stage = 0 */ } /* Start region 7 */
0x2 : > { %s3 = sadd.s32 1, %s2  ;;  %p4 = scmp.ne.s32.totalorder %s2, 0 }
0x3 : > { %p5 = scmp.lt.s32.totalorder %s3, 10  ;;  %6 = sbr.rel (%p4) target = $region9 }
0x4 :  {}
0x5 :  {}
0x6 :  {}
0x7 :  {}
0x8 : > { %7 = vmatmul.bf16.gmra.mxu0 %v1  ;;  %8 = vst [vmem:[#allocation3_spill] sm:$0xff] %v1 }
0x9 PF: > { %9 = vpop.f32.mrf.mxu0 } /* Start/End empty region 9 */
0xa :  { %10 = sbr.rel (%p5) target = $region7 }
0xb :  {}
0xc :  {}
0xd :  {}
0xe :  {}
0xf :  {} /* exit bundle: %k.1 = custom-call(%a) */
"""


def test_tiny_listing_semantics():
    sched = llo.build_schedule(bundle_listing.parse_bundles(TINY, "k.1"))
    (loop,) = sched.loops
    assert (loop.start, loop.end, loop.branch, loop.trip_count) == (1, 14, 10, 10)
    (region,) = loop.regions
    # skipped unless the counter is 0: runs once, not a pipeline guard
    assert (region.start, region.end, region.executed_iterations, region.guard) == (8, 8, 1, False)
    assert loop.predicated_bundles == 1 and loop.guarded_bundles == 0
    assert loop.executed_bundles == 10 * 14 - 9
    assert sched.executed_bundles == 131 + 2
    assert sched.mxu_ops == 1 and sched.spill_stores == 1
    assert sched.grid is None and sched.trip_count == 10
    assert llo.is_pallas_kernel(sched)
    # One bfloat16 vmatmul (16 rows) run once keeps mxu0 busy 16 cycles.
    assert loop.executed_mxu_cycles_min == loop.executed_mxu_cycles_max == 16
    assert sched.executed_mxu_cycles_min == sched.executed_mxu_cycles_max == 16


def test_a_loop_counter_kept_in_a_reused_spill_slot_is_followed():
    """The counter lives in a spill slot that also holds another value for part of each
    iteration (splash's fused backward): the fill at the loop head reads the store before the
    loop on the first iteration and the body's last store after; the trip count and the
    region's predicate are read as if the counter were an ``sphi``."""
    text = (
        TINY.replace(
            "{ %s1 = smov 0 /* copy for cssa */ }",
            "{ %s1 = smov 0  ;;  %50 = sst [smem:[#allocation4_spill]] %s1 }",
        )
        .replace(
            "{ %s2 = sphi %s1, %s3 /* iteration index, stage = 0 */ }",
            "{ %s2 = sld [smem:[#allocation4_spill]] }",
        )
        .replace("0x4 :  {}", "0x4 : > { %51 = sst [smem:[#allocation4_spill]] %s40 }")
        .replace("0xb :  {}", "0xb :  { %52 = sst [smem:[#allocation4_spill]] %s3 }")
    )
    (loop,) = bundle_listing.parse_bundles(text, "k.1").loops
    assert loop.trip_count == 10
    (region,) = loop.regions
    assert region.executed_iterations == 1
    # the body's store inside the predicated region instead: the value that reaches the back
    # edge is undecidable, and so is the trip count
    undecided = text.replace("0xb :  { %52 = sst [smem:[#allocation4_spill]] %s3 }", "0xb :  {}")
    undecided = undecided.replace(
        "%7 = vmatmul", "%52 = sst [smem:[#allocation4_spill]] %s3  ;;  %7 = vmatmul"
    )
    (loop,) = bundle_listing.parse_bundles(undecided, "k.1").loops
    assert loop.trip_count is None


def test_mxu_cycles_count_every_executed_vmatmul_per_mxu():
    """Two bfloat16 vmatmuls on mxu1 in every iteration and a float32 one (8 rows) on mxu2:
    mxu1 is the busiest, 10 x 2 x 16 = 320 cycles, more than the 133 bundles executed."""
    text = TINY.replace(
        "0x4 :  {}",
        "0x4 : > { %20 = vmatmul.bf16.gmra.mxu1 %v1  ;;  %21 = vmatmul.f32.gmra.mxu2 %v1 }",
    ).replace("0x5 :  {}", "0x5 : > { %22 = vmatmul.bf16.gmra.mxu1 %v1 }")
    sched = llo.build_schedule(bundle_listing.parse_bundles(text, "k.1"))
    assert sched.executed_bundles == 133
    assert sched.executed_mxu_cycles_min == sched.executed_mxu_cycles_max == 320


def test_v7x_vmatmuls_into_a_result_buffer_count_on_the_mxu_they_name():
    """v7x's listings index the MXU's result buffer in the mnemonic
    (``vmatmul.mubr.bf16.gmra.mrb[4].mxu0``): the unit is still its last suffix, so the two
    MXUs are counted apart: 10 x 16 / 2 = 80 cycles each at v7x's two rows a cycle, and the
    busiest, mxu0, 8 more for the listing's own vmatmul run once (88, not the 160 of one
    unit)."""
    text = TINY.replace(
        "0x4 :  {}",
        "0x4 : > { %20 = vmatmul.mubr.bf16.gmra.mrb[4].mxu0 %v1  ;;  "
        "%21 = vmatmul.mubr.bf16.gmra.mrb[0].mxu1 %v1 }",
    ).replace("0x5 :  {}", "0x5 : > { %22 = vpop.f32.mrb[4].mxu0 }")
    listing = bundle_listing.parse_bundles(text, "k.1", mxu_rows_per_cycle=2)
    popped = [i for b in listing.bundles for i in b.instructions if i.dest == "%22"]
    assert popped[0].opcode == "vpop.f32.mrb[4].mxu0" and popped[0].args == ""
    assert sorted(listing.mxu_prefixes) == ["mxu0", "mxu1"]
    sched = llo.build_schedule(listing)
    assert sched.executed_mxu_cycles_min == sched.executed_mxu_cycles_max == 88


def test_tiny_listing_guard_and_negated_exit():
    text = TINY.replace("scmp.ne.s32.totalorder %s2, 0", "scmp.eq.s32.totalorder %s2, 9")
    text = text.replace("scmp.lt.s32.totalorder %s3, 10", "scmp.ge.s32.totalorder %s3, 12")
    text = text.replace("sbr.rel (%p5)", "sbr.rel (!%p5)")
    (loop,) = bundle_listing.parse_bundles(text, "k.1").loops
    assert loop.trip_count == 12
    (region,) = loop.regions
    assert region.guard and region.executed_iterations == 11
    assert loop.predicated_bundles == 0 and loop.guarded_bundles == 1
    assert loop.executed_bundles == 12 * 14 - 1


def test_no_loop_kernel():
    text = "\n".join(
        [
            "     0   :  { %s1_s0 = smov 0 }",
            "   0x1   :  { %2 = vst [vmem:[%s1_s0] sm:$0xff] %v0_v0 }",
            "   0x2   :  {} /* exit bundle: %fusion.1 = fusion(%p) */",
        ]
    )
    sched = llo.build_schedule(bundle_listing.parse_bundles(text, "fusion.1"))
    assert sched.loops == () and sched.grid_loop is None
    assert sched.bundles_per_step == 3 and sched.trip_count == 1 and sched.predicated_bundles == 0
    assert sched.executed_bundles == 3
    assert not llo.is_pallas_kernel(sched)


# --------------------------------------------------------------------------------------------
# Full real dumps, when this machine has them

REAL = Path("/tmp/llo_samples")
REAL_NONCAUSAL = REAL / "flash_noncausal" / "dump"


@pytest.mark.skipif(not REAL.is_dir(), reason="no /tmp/llo_samples dumps on this machine")
def test_real_dumps_invariants():
    pallas_seen = set()
    for dump_dir in sorted(REAL.glob("*/dump")):
        for name, s in llo.load_dump(dump_dir).items():
            assert not name.startswith("<") and name != "TLP"
            # every row and every bundle accounted for
            assert not [w for w in s.warnings if "rows" in w or "reports" in w], (name, s.warnings)
            assert all(0.0 <= s.utilization(u) <= 1.0 for u in s.units), name
            if llo.is_pallas_kernel(s):
                pallas_seen.add(name)
                loop = s.grid_loop
                assert loop is not None and loop.depth == 1
                assert s.trip_count == s.grid_steps + 2
                assert s.mxu_ops > 0
                guard = loop.regions[0]
                assert guard.guard and guard.executed_iterations == s.grid_steps
                assert 0 < loop.predicated_bundles < loop.bundles
                lo, hi = loop.executed_bundles_min, loop.executed_bundles_max
                assert lo is not None and hi is not None
                assert s.grid_steps * (loop.bundles - loop.predicated_bundles) <= lo <= hi
                assert hi <= s.trip_count * loop.bundles
    assert {
        "flash_attention.1",
        "splash_mha_fwd_residuals.1",
        "splash_mha_dq_no_residuals.1",
        "splash_mha_dkv_no_residuals.1",
    } <= pallas_seen
    flash = llo.load_dump(REAL / "flash_causal" / "dump")["flash_attention.1"]
    assert flash.grid == (1, 4, 4, 4)
    assert [r.executed_iterations for r in flash.grid_loop.regions] == [64, 16, 40, 16]
    xla = llo.load_dump(REAL / "xla_dense_transpose" / "dump")
    assert sorted(xla) == ["copy.2", "fusion.12", "fusion.9", "iota_compare_fusion"]
    assert not any(llo.is_pallas_kernel(s) for s in xla.values())


@pytest.mark.skipif(
    not REAL_NONCAUSAL.is_dir(), reason="no non-causal flash dump under /tmp/llo_samples"
)
def test_real_noncausal_flash():
    flash = llo.load_dump(REAL_NONCAUSAL)["flash_attention.1"]
    assert llo.is_pallas_kernel(flash)
    assert flash.grid == (1, 16, 8, 8) and flash.trip_count == 1024 + 2
    assert 1400 < flash.bundles_per_step < 1800
    assert flash.mxu_ops > 0 and flash.spill_stores > 0
    regions = flash.grid_loop.regions
    # non-causal: only the pipeline guard, the init (first kv block) and the write-back (last)
    assert [r.executed_iterations for r in regions] == [1024, 128, 128]
    assert flash.grid_loop.executed_bundles is not None
    assert flash.warnings == ()


def test_vmem_bytes_sum_the_vmem_allocations() -> None:
    """Real allocation list of flash_attention with 512 blocks: 3 f32 scratch blocks and 4
    double-buffered bf16 windows of 256 KiB each, plus 36 KiB of internal scratch; the sflag
    and smem allocations are not VMEM."""
    text = (SAMPLES / "flash_attention_allocations.txt").read_text()
    assert dump_files.parse_vmem_bytes(text) == 7 * 256 * 1024 + 0x9000


def test_executed_weight_and_instruction_on_the_tiny_listing():
    """Weights per bundle weigh like the bundles: bundle 8 (in the region run once) counts
    once, bundle 2 (every iteration) ten times, bundle 0 (before the loop) once. A guarded
    instruction runs on the iterations its predicate allows within its regions."""
    text = TINY.replace(
        "0x8 : > { %7 = vmatmul",
        "0x8 : > { %11 = dma.hbm_to_vmem [thread:$0] (!%p4), %s1 ;; %7 = vmatmul",
    )
    listing = bundle_listing.parse_bundles(text, "k.1")
    weights = [0] * len(listing.bundles)
    weights[0], weights[2], weights[8] = 100, 10, 1
    assert llo.executed_weight(listing, [bundle_weights.prefix_sums(weights)]) == (201, 201)
    # several weights (MXUs): the busiest outside the loops (100) plus the busiest in the loop
    # (the second, 10 x 30)
    other = [0] * len(listing.bundles)
    other[2] = 30
    both = [bundle_weights.prefix_sums(weights), bundle_weights.prefix_sums(other)]
    assert llo.executed_weight(listing, both) == (400, 400)
    (dma,) = [ins for b in listing.bundles for ins in b.instructions if ins.base == "dma"]
    assert dma.args.startswith("[thread:$0] (!%p4)")
    # inside the region skipped unless the counter is 0; its own guard is the same predicate
    assert llo.executed_instruction(listing, 8, "!%p4") == (1, 1)
    assert llo.executed_instruction(listing, 8, "%p4") == (0, 0)
    assert llo.executed_instruction(listing, 2, "%p4") == (9, 9)
    assert llo.executed_instruction(listing, 0, None) == (1, 1)  # before the loop: once
    assert llo.executed_instruction(listing, 2, "%p99") == (0, 10)  # undecidable predicate


def test_buffer_slot_counters_are_evaluated_per_iteration():
    """A phi stepping by 0 or 1 (a pipeline's buffer slot) and one holding the previous
    iteration's value of another: the pattern the DMA predicates of a Pallas pipeline compare."""
    text = TINY.replace(
        "  0 :  { %s1 = smov 0 /* copy for cssa */ }",
        "  0 :  { %s1 = smov 0 /* copy for cssa */  ;;  %s40 = smov 0  ;;  %s41 = smov 0 }",
    ).replace(
        "0x2 : > { %s3 = sadd.s32 1, %s2",
        "0x2 : > { %s42 = sphi %s40, %s46  ;;  %s43 = sphi %s41, %s42  ;;  "
        "%s44 = sand.u32 1, %s2  ;;  %p45 = scmp.eq.s32.totalorder %s44, 0  ;;  "
        "%s47 = sadd.s32 1, %s42  ;;  %s46 = scalar_select %p45, %s42, %s47  ;;  "
        "%p48 = scmp.ne.s32.totalorder %s42, %s43  ;;  %s3 = sadd.s32 1, %s2",
    )
    listing = bundle_listing.parse_bundles(text, "k.1")
    # the slot steps after each odd iteration: 0 0 1 1 2 2 ...; it differs from its previous
    # value on iterations 2, 4, 6, 8
    assert llo.executed_instruction(listing, 2, "%p48") == (4, 4)


def test_a_division_by_three_is_evaluated() -> None:
    """Mosaic divides by a constant that is no power of two with the high word of a multiply
    (``smulhi``): a predicate on ``i // 3`` is decided, not left to run on every iteration."""
    text = TINY.replace(
        "0x2 : > { %s3 = sadd.s32 1, %s2",
        "0x2 : > { %s44 = smulhi.u32 2863311531, %s2  ;;  %s45 = sshrl.u32 %s44, 1  ;;  "
        "%p48 = scmp.eq.s32.totalorder %s45, 1  ;;  %s3 = sadd.s32 1, %s2",
    )
    listing = bundle_listing.parse_bundles(text, "k.1")
    assert llo.executed_instruction(listing, 2, "%p48") == (3, 3)  # iterations 3, 4 and 5


def test_a_hardware_divide_is_evaluated() -> None:
    """Mosaic divides by some constants with ``sdivrem`` and pops the quotient, then the
    remainder (``spop.drf``): predicates on ``i // 3`` and ``i % 3`` are decided."""
    text = TINY.replace(
        "0x2 : > { %s3 = sadd.s32 1, %s2",
        "0x2 : > { %44 = sdivrem.u32 %s2, 3 /* kDivAndRem */  ;;  %s45 = spop.drf %44  ;;  "
        "%s46 = spop.drf %44  ;;  %p47 = scmp.eq.s32.totalorder %s45, 1  ;;  "
        "%p48 = scmp.eq.s32.totalorder %s46, 0  ;;  %s3 = sadd.s32 1, %s2",
    )
    listing = bundle_listing.parse_bundles(text, "k.1")
    assert llo.executed_instruction(listing, 2, "%p47") == (3, 3)  # iterations 3, 4 and 5
    assert llo.executed_instruction(listing, 2, "%p48") == (4, 4)  # iterations 0, 3, 6 and 9


NESTED = (
    TINY[: TINY.index("0x8 :")].replace("scmp.ne.s32", "scmp.eq.s32")
    + """\
0x8 : > { %s20 = sand.u32 1, %s2  ;;  %p21 = scmp.eq.s32.totalorder (GUARD), %s20, 0 }
0x9 : > { %22 = sbr.rel (%p21) target = $region10 }
0xa :  {}
0xb :  {}
0xc :  {}
0xd :  {}
0xe : > { %7 = vmatmul.bf16.gmra.mxu0 %v1 }
0xf PF: > {} /* Start/End empty region 10 */
0x10 PF: > {} /* Start/End empty region 9 */
0x11 :  { %10 = sbr.rel (%p5) target = $region7 }
0x12 :  {}
0x13 :  {}
0x14 :  {}
0x15 :  {}
0x16 :  {} /* exit bundle: %k.1 = custom-call(%a) */
"""
)
"""TINY's loop with the region skipped at counter 0 only (outer, bundles 8-15) holding one
skipped on even counters (inner, bundle 14) whose predicate a guarded compare defines."""


@pytest.mark.parametrize(("guard", "runs"), [("!%p4", 5), ("%p4", None)])
def test_a_predicate_defined_under_the_enclosing_regions_guard_is_decided(guard, runs):
    """The inner region's skip predicate (counter even) is computed by a predicated compare.
    Guarded by the outer region's own condition (it runs whenever the inner region can be
    reached) it is exact there: the inner region runs on the odd counters 1..9. Guarded by
    anything else it may hold a stale value: undecided."""
    listing = bundle_listing.parse_bundles(NESTED.replace("GUARD", guard), "k.1")
    (loop,) = listing.loops
    outer, inner = sorted(loop.regions, key=lambda r: r.start)
    assert (outer.start, outer.end, outer.executed_iterations) == (8, 15, 9)
    assert (inner.start, inner.end, inner.executed_iterations) == (14, 14, runs)


def test_a_guard_that_holds_in_one_chunk_of_iterations_only_decides_nothing(monkeypatch):
    """Iterations are evaluated in chunks; a guard that covers the reached iterations of the
    first chunk (counter < 5) but not of the second leaves the region undecided, not half
    decided."""
    monkeypatch.setattr(scalar_flow, "_EVAL_CHUNK", 4)
    text = NESTED.replace("GUARD", "%p30").replace(
        "%p4 = scmp.eq.s32.totalorder %s2, 0", "%p4 = scmp.eq.s32.totalorder %s2, 0  ;;  "
        "%p30 = scmp.lt.s32.totalorder %s2, 5",
    )  # fmt: skip
    listing = bundle_listing.parse_bundles(text, "k.1")
    (loop,) = listing.loops
    outer, inner = sorted(loop.regions, key=lambda r: r.start)
    assert (outer.executed_iterations, inner.executed_iterations) == (9, None)


GRID_COUNTERS = """\
    %s16 = sphi 0, %s42 /* iteration index, stage = 0 iter bound = 0 */
    %s17 = sphi 0, %s38 /* iteration index, stage = 0 iter bound = 1 */
    %s18 = sphi 0, %s34 /* iteration index, stage = 0 iter bound = 2 */
    %s20 = sphi 0, %s16 /* iteration index, stage = 1 iter bound = 0 */
    %s31 = sadd.s32 1, %s18
    %p33 = scmp.ge.s32.totalorder %s31, 4
    %s34 = scalar_select /*predicate=*/%p33, /*on_true=*/0, /*on_false=*/%s31
    %s35 = sadd.s32 1, %s17
    %s36 = scalar_select /*predicate=*/%p33, /*on_true=*/%s35, /*on_false=*/%s17
    %p37 = scmp.ge.s32.totalorder %s36, 16
    %s38 = scalar_select /*predicate=*/%p37, /*on_true=*/0, /*on_false=*/%s36
    %s39 = sadd.s32 1, %s16
    %s40 = scalar_select /*predicate=*/%p37, /*on_true=*/%s39, /*on_false=*/%s16
    %p41 = scmp.ge.s32.totalorder %s40, 1
    %s42 = scalar_select /*predicate=*/%p41, /*on_true=*/0, /*on_false=*/%s40
"""


def test_the_grid_is_read_from_the_index_counters():
    """The first LLO pass's grid-index phis wrap at each dimension's size (lines as libtpu
    writes them); a dimension whose wrap is missing leaves the grid unknown."""
    assert dump_files.parse_grid(GRID_COUNTERS) == (1, 16, 4)
    assert dump_files.parse_grid(GRID_COUNTERS.replace("%s40, 1\n", "%s40, %s9\n")) is None
    assert dump_files.parse_grid("no counters") is None
    # it stands in for the DMA descriptors' iteration bounds only when there are none
    assert bundle_listing.parse_bundles(TINY, "k.1", counter_grid=(10,)).grid == (10,)


def test_a_grid_sized_by_a_scalar_operand_is_read_where_the_program_holds_its_value():
    """A dimension sized at run time wraps at the kernel's scalar operand (tokamax's causal
    forward: ``scmp.ge %s59, %s0``): its size is the operand's value in the program's HLO,
    unknown without it or where the operand is an array."""
    operand = "  %s9 = inlined_call_operand.<no memory space> [shape: s32[], index: 0, kind: x]\n"
    dynamic = operand + GRID_COUNTERS.replace("%s36, 16\n", "%s36, %s9\n")
    assert dump_files.parse_grid(dynamic, {0: 528}) == (1, 528, 4)
    assert dump_files.parse_grid(dynamic) is None
    assert dump_files.parse_grid(dynamic, {1: 528}) is None
    assert dump_files.parse_grid(dynamic, {0: (1, 2)}) is None


@pytest.mark.parametrize(
    ("dma_grid", "counter_grid", "trip", "grid"),
    [
        ((4, 8), (1, 1), 34, (4, 8)),  # the DMA descriptors' bounds, all static, come first
        ((4, bundle_listing.DYNAMIC_DIM), (4, 6), 26, (4, 6)),  # then the counters'
        ((bundle_listing.DYNAMIC_DIM,), None, 66, (64,)),  # then the grid loop's trips
        ((2, bundle_listing.DYNAMIC_DIM), None, 67, None),  # which the other dims must divide
        ((bundle_listing.DYNAMIC_DIM,) * 2, None, 66, None),  # for one unknown dimension
        ((bundle_listing.DYNAMIC_DIM,), None, None, None),
        (None, (3,), 5, (3,)),
    ],
)
def test_a_grid_sized_at_run_time_is_known_only_from_what_the_program_holds(
    dma_grid, counter_grid, trip, grid
):
    """jax prints a dimension sized at run time as int32's largest value in the DMA
    descriptors' iteration bounds: never a grid; the counters' grid or the grid loop's trip
    count less its fill/drain iterations (2 stages) stand in where they can."""
    assert bundle_listing._sized_grid(dma_grid, counter_grid, trip, 2) == grid


def test_constants_fold_through_the_arithmetic_of_known_operands():
    """The grid loop of a grid sized at run time runs to ``16 * %s0 + 2``: a constant once
    the operand's value is known; a load from memory stays unknown."""
    text = """\
0x0 :  { %s1_s0 = inlined_call_operand.<no memory space> [shape: s32[], index: 0, kind: input] }
0x1 :  { %s2_s1 = smul.u32 16, %s1_s0  ;;  %s3_s2 = sadd.s32 %s2_s1, 2 }
0x2 :  { %s4_s3 = sshll.u32 %s3_s2, 1  ;;  %s5_s4 = sld [smem:[#allocation2]] }
0x3 :  { %s6_s5 = ssub.s32 %s4_s3, %s5_s4 }
"""  # fmt: skip
    defs = scalar_defs.Defs(bundles.scan_bundles(text), {0: 528})
    assert defs.constant("%s3_s2") == 16 * 528 + 2 and defs.constant("%s4_s3") == 2 * 8450
    assert defs.constant("%s6_s5") is None
    assert scalar_defs.Defs(bundles.scan_bundles(text)).constant("%s3_s2") is None


TABLE_COPY = """\
0x0 :  { %s7_s19 = smov [#allocation6] /* materialized constant */ }
0x1 :  { %s1_s1 = inlined_call_operand.vmem [shape: s32[528], index: 1, kind: input] }
0x2 :  { %s16_s15 = sshll.u32 %s1_s1, 4 }
0x3 :  { %s17_s15 = int_to_ptr.vmem [resolvable:$true] %s16_s15 }
0x4 :  { %19 = dma.vmem_to_smem /*vmem=*/%s17_s15, /*size_in_granules=*/80, /*smem=*/%s7_s19 }
0x5 :  { %s20_s2 = sld [smem:[#allocation6 + %s9_s9]] }
"""  # fmt: skip


@pytest.mark.parametrize(
    ("change", "operands", "tables"),
    [
        ({}, {1: tuple(range(528))}, {"#allocation6": tuple(range(528))}),
        ({}, {}, {}),  # the operand's values are not known
        ({"80,": "40,"}, {1: tuple(range(528))}, {}),  # 320 words copied: not the whole table
        ({"0x5 :  {": "0x5 :  { %21 = sst [smem:[#allocation6 + $0x4]] %s2_s2  ;;"},
         {1: tuple(range(528))}, {}),  # something else is written there
    ],
)  # fmt: skip
def test_an_smem_allocation_holds_a_constant_table_only_if_copied_whole_from_one(
    change, operands, tables
):
    """A block-sparse mask's tables (splash's MaskInfo) are copied from constant operands
    into SMEM once and read there: such an allocation is a constant table."""
    text = TABLE_COPY
    for old, new in change.items():
        text = text.replace(old, new)
    assert scalar_defs.Defs(bundles.scan_bundles(text), operands).tables == tables


def test_the_dump_flags_ask_libtpu_for_every_pass_read_and_no_other(tmp_path):
    """`dump_flags` filters libtpu's dump to the passes `find_dump_files` reads: every stage
    of the sample dumps is matched, and none of the 60-odd others a compile writes."""
    flags = dump_files.dump_flags(tmp_path)
    assert flags.startswith(f"--xla_jf_dump_to={tmp_path} --xla_jf_dump_llo_pass_label_regex=")
    regex = re.compile(flags.split("=", 2)[2])
    read = {re.sub(r"^\d+-.+-\d+-", "", p.name)[:-4] for p in SPLASH.glob("*-*-*-*.txt")}
    read |= {"original", "critical-path"}  # the grid and allocations, the critical path
    assert all(regex.fullmatch(stage) for stage in read), read
    for stage in ("post-ra", "DGO-post-critical-path-scheduler", "packed-bundles-post-ra",
                  "pre-delay_hlo-static-per-bundle-utilization", "post-GVN"):  # fmt: skip
        assert not regex.fullmatch(stage)
