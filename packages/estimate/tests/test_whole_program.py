# ruff: noqa: E501 - HLO lines are as long as the compiler prints them
"""Whole-program counting: loop trip counts from the HLO, collectives once per channel, and
the ICI model's figures."""

from __future__ import annotations

import dataclasses

import pytest

from pallas_flash_estimate.cost import kernel_cost, op_bytes
from pallas_flash_estimate.evaluate import program_loops
from pallas_flash_estimate.program import ici, whole_program
from pallas_flash_estimate.read import hlo
from pallas_flash_estimate.targets import TARGETS

# The shape libtpu leaves a scanned layer loop in (counter copied in and out of SMEM, the
# bound a constant of the condition), with an asynchronous collective split over two
# computations that share its channel id.
SCANNED = """\
HloModule jit_step

%cond (p.1: (s32[], f32[8])) -> pred[] {
  %bound = s32[]{:T(128)} constant(12)
  %p.1 = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %i.1 = s32[]{:T(128)} get-tuple-element(%p.1), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i.1, %bound), direction=LT
}

%fused_gather (param_0: f32[2]) -> f32[8] {
  %param_0 = f32[2]{0} parameter(0)
  ROOT %all-gather.7 = f32[8]{0} all-gather(%param_0), channel_id=5, replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={0}
}

%fused_done (param_0.1: f32[2]) -> f32[8] {
  %param_0.1 = f32[2]{0} parameter(0)
  ROOT %all-gather.8 = f32[8]{0} all-gather(%param_0.1), channel_id=5, replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={0}
}

%body (p.2: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.2 = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %i.2 = s32[]{:T(128)} get-tuple-element(%p.2), index=0
  %i.3 = s32[]{:T(128)S(6)} copy(%i.2)
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i.3, %one)
  %x = f32[8]{0} get-tuple-element(%p.2), index=1
  %slice = f32[2]{0} slice(%x), slice={[0:2]}
  %async-collective-start.3 = f32[8]{0} fusion(%slice), kind=kCustom, calls=%fused_gather
  %async-collective-done.3 = f32[8]{0} fusion(%slice), kind=kCustom, calls=%fused_done
  %add.1 = f32[8]{0} add(%async-collective-done.3, %x)
  ROOT %t.2 = (s32[]{:T(128)}, f32[8]{0}) tuple(%next, %add.1)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %zero = s32[]{:T(128)} constant(2)
  %zero.copy = s32[]{:T(128)} copy(%zero)
  %init = (s32[]{:T(128)}, f32[8]{0}) tuple(%zero.copy, %a)
  %loop = (s32[]{:T(128)}, f32[8]{0}) while(%init), condition=%cond, body=%body
  %out = f32[8]{0} get-tuple-element(%loop), index=1
  ROOT %sum = f32[8]{0} all-reduce(%out), channel_id=9, replica_groups={{0,1,2,3}}, to_apply=%cond
}
"""


def test_a_loop_s_trip_count_comes_from_its_bound_start_and_step() -> None:
    runs = program_loops.program_runs(SCANNED)
    assert runs.trips == {"loop": 10}  # i = 2; i < 12; i += 1
    assert runs.runs("add.1") == 10 and runs.runs("slice") == 10
    assert runs.runs("all-gather.7") == 10  # inside a fusion of the body
    assert runs.runs("sum") == 1
    assert runs.undetermined == []


def test_a_loop_of_another_shape_is_undetermined_and_counted_once() -> None:
    text = SCANNED.replace("%next = s32[]{:T(128)} add(%i.3, %one)",
                           "%next = s32[]{:T(128)} multiply(%i.3, %one)")  # fmt: skip
    runs = program_loops.program_runs(text)
    assert runs.trips == {"loop": None} and runs.undetermined == ["loop"]
    assert runs.runs("add.1") == 1


def test_a_known_trip_count_wins() -> None:
    known = 'body=%body, backend_config={"known_trip_count":{"n":"32"}}'
    text = SCANNED.replace("body=%body", known)
    assert program_loops.program_runs(text).trips == {"loop": 32}


def test_an_asynchronous_collective_counts_once_per_channel() -> None:
    comps = hlo.parse_computations(SCANNED)
    program = program_loops.program_runs(SCANNED, comps)
    groups = program_loops.collective_groups(
        comps, program, program_loops.collective_keys(comps, program)
    )
    found = {key: (op.name, runs) for key, (op, runs) in groups.items()}
    assert found == {"async-collective-start.3": ("all-gather.7", 10), "sum": ("sum", 1)}


def test_collective_ops_that_share_a_channel_id_are_two_collectives() -> None:
    # shard_map's reductions may all carry channel_id=1: each op is its own collective
    twice = SCANNED.replace(
        "  ROOT %sum = f32[8]{0} all-reduce(%out)",
        "  %max = f32[8]{0} all-reduce(%out), channel_id=9, replica_groups={{0,1,2,3}}, "
        "to_apply=%cond\n  ROOT %sum = f32[8]{0} all-reduce(%max)",
    )
    comps = hlo.parse_computations(twice)
    program = program_loops.program_runs(twice, comps)
    groups = program_loops.collective_groups(
        comps, program, program_loops.collective_keys(comps, program)
    )
    assert sorted(groups) == ["async-collective-start.3", "max", "sum"]


def test_an_all_reduce_sliced_to_each_chip_is_a_reduce_scatter() -> None:
    # XLA's all-reduce-scatter fusion: FSDP's gradient reduction
    scatter = SCANNED.replace(
        "  ROOT %sum = f32[8]{0} all-reduce(%out), channel_id=9, replica_groups={{0,1,2,3}}, "
        "to_apply=%cond",
        "  %half = f32[2]{0} fusion(%out), kind=kCustom, calls=%all-reduce-scatter\n"
        "  ROOT %sum = f32[2]{0} fusion(%out), kind=kCustom, calls=%all-reduce-scatter",
    ).replace(
        "ENTRY %main",
        """%all-reduce-scatter (param_1: f32[8]) -> f32[2] {
  %param_1 = f32[8]{0} parameter(0)
  %reduced = f32[8]{0} all-reduce(%param_1), channel_id=9, replica_groups={{0,1,2,3}}, to_apply=%cond
  %id = u32[] partition-id()
  %two = u32[] constant(2)
  %offset = u32[] multiply(%id, %two)
  ROOT %slice.1 = f32[2]{0} dynamic-slice(%reduced, %offset), dynamic_slice_sizes={2}
}

ENTRY %main""",
    )
    comps = hlo.parse_computations(scatter)
    program = program_loops.program_runs(scatter, comps)
    groups = program_loops.collective_groups(
        comps, program, program_loops.collective_keys(comps, program)
    )
    # two collective fusions of their own, though they share channel 9
    assert sorted(groups) == ["async-collective-start.3", "half", "sum"]
    op, runs = groups["sum"]
    assert (op.opcode, op.bytes, runs) == ("all-reduce-scatter", 32, 1)
    (entry,) = ici.program_collectives([(op, runs)], 4, TARGETS["v5e-4"])
    reduce_scatter = ici.collective_seconds("reduce-scatter", 8, 4, TARGETS["v5e-4"])
    assert entry["seconds"] == pytest.approx(reduce_scatter)  # not the all-reduce's twice


def test_group_sizes_in_each_replica_group_format() -> None:
    ops = {op.name: op for op in hlo.parse_entry(SCANNED)}
    assert ici.group_size(ops["sum"], 256) == 4
    comps = hlo.parse_computations(SCANNED)
    assert ici.group_size(comps["fused_gather"].ops[-1], 256) == 4
    iota = hlo.HloOp("x", "all-gather", "f32[8]", 32, (), "",
                     attributes="replica_groups=[32,8]<=[256], dimensions={0}")  # fmt: skip
    assert ici.group_size(iota, 256) == 8
    assert ici.group_size(hlo.HloOp("y", "all-reduce", "f32[8]", 32, (), ""), 16) == 16


def test_ring_traffic_bandwidth_and_steps_on_a_torus() -> None:
    pod, small = TARGETS["v5e-256"], TARGETS["v5e-8"]
    size = 1 << 30
    # 256 chips: both sides of the 16 x 16 pod, both ways round each (4 links' bandwidth),
    # 15 + 15 ring steps
    assert ici.collective_seconds("all-gather", size, 256, pod) == pytest.approx(
        pod.collective_latency + 30 * pod.ici_hop_latency
        + size * 255 / 256 / (4 * pod.ici_link_bandwidth)
    )  # fmt: skip
    # 4 chips along the 4-chip side of a 2 x 4 slice, which does not wrap: one link
    assert ici.collective_seconds("reduce-scatter", size, 4, small) == pytest.approx(
        small.collective_latency + 3 * small.ici_hop_latency + size * 3 / small.ici_link_bandwidth
    )
    assert ici.collective_seconds("all-reduce", size, 1, pod) == 0.0
    assert ici.step_bounds(2.0, 0.5) == (2.0, 2.5)


# A decode step's cache update, one layer's twice over (as an unrolled model has it): the
# fusion reads one row of the cache and writes it in place; the weights are prefetched.
UPDATES = """\
HloModule jit_decode

%fused_row (param_0.1: bf16[32,8,256,64], param_1.1: bf16[32,8,1,64], param_2.1: s32[]) -> bf16[32,8,256,64] {
  %param_0.1 = bf16[32,8,256,64]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1.1 = bf16[32,8,1,64]{3,2,1,0:T(2,128)(2,1)} parameter(1)
  %param_2.1 = s32[]{:T(128)} parameter(2)
  %zero.1 = s32[]{:T(128)} constant(0)
  ROOT %update.1 = bf16[32,8,256,64]{3,2,1,0:T(8,128)(2,1)} dynamic-update-slice(%param_0.1, %param_1.1, %zero.1, %zero.1, %param_2.1, %zero.1)
}

%fused_row.1 (param_0.2: bf16[32,8,256,64], param_1.2: bf16[32,8,1,64], param_2.2: s32[]) -> bf16[32,8,256,64] {
  %param_0.2 = bf16[32,8,256,64]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1.2 = bf16[32,8,1,64]{3,2,1,0:T(2,128)(2,1)} parameter(1)
  %param_2.2 = s32[]{:T(128)} parameter(2)
  %zero.2 = s32[]{:T(128)} constant(0)
  ROOT %update.2 = bf16[32,8,256,64]{3,2,1,0:T(8,128)(2,1)} dynamic-update-slice(%param_0.2, %param_1.2, %zero.2, %zero.2, %param_2.2, %zero.2)
}

%fused_read (param_0.3: bf16[32,8,256,64], param_1.3: s32[]) -> bf16[32,8,1,64] {
  %param_0.3 = bf16[32,8,256,64]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1.3 = s32[]{:T(128)} parameter(1)
  %zero.3 = s32[]{:T(128)} constant(0)
  ROOT %row = bf16[32,8,1,64]{3,2,1,0:T(2,128)(2,1)} dynamic-slice(%param_0.3, %zero.3, %zero.3, %param_1.3, %zero.3), dynamic_slice_sizes={32,8,1,64}
}

ENTRY %main (cache: bf16[32,8,256,64], cache.1: bf16[32,8,256,64], new: bf16[32,8,1,64], at: s32[], w: bf16[2048,1024]) -> bf16[32,8,256,64] {
  %cache = bf16[32,8,256,64]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %cache.1 = bf16[32,8,256,64]{3,2,1,0:T(8,128)(2,1)} parameter(1)
  %new = bf16[32,8,1,64]{3,2,1,0:T(2,128)(2,1)} parameter(2)
  %at = s32[]{:T(128)} parameter(3)
  %w = bf16[2048,1024]{1,0:T(8,128)(2,1)} parameter(4)
  %write = bf16[32,8,256,64]{3,2,1,0:T(8,128)(2,1)} fusion(%cache, %new, %at), kind=kLoop, calls=%fused_row
  %write.1 = bf16[32,8,256,64]{3,2,1,0:T(8,128)(2,1)} fusion(%cache.1, %new, %at), kind=kLoop, calls=%fused_row.1
  %read = bf16[32,8,1,64]{3,2,1,0:T(2,128)(2,1)} fusion(%write, %at), kind=kLoop, calls=%fused_read
  %prefetch = ((bf16[2048,1024]{1,0:T(8,128)(2,1)}), bf16[512,1024]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:512], [0:1024]}
  ROOT %out = bf16[32,8,256,64]{3,2,1,0:T(8,128)(2,1)} add(%write.1, %write)
}
"""


def test_hbm_bytes_of_in_place_updates_partial_reads_and_prefetches() -> None:
    comps = hlo.parse_computations(UPDATES)
    ops = {op.name: op for comp in comps.values() for op in comp.ops}
    shapes = {name: op.shape for name, op in ops.items()}
    row = 32 * 8 * 1 * 64 * 2
    index = 4  # the s32 position, in HBM too
    # the update is written; the cache is neither read nor rewritten; the new row is read
    assert op_bytes.op_hbm_bytes(ops["write"], comps, shapes) == 2 * row + index
    assert op_bytes.op_hbm_bytes(ops["read"], comps, shapes) == 2 * row + index  # a row, out
    assert op_bytes.op_hbm_bytes(ops["prefetch"], comps, shapes) == 512 * 1024 * 2
    cache = 32 * 8 * 256 * 64 * 2
    assert op_bytes.op_hbm_bytes(ops["out"], comps, shapes) == 3 * cache


def test_ops_of_one_program_share_its_listing() -> None:
    comps = hlo.parse_computations(UPDATES)
    ops = {op.name: op for comp in comps.values() for op in comp.ops}
    shapes = {name: op.shape for name, op in ops.items()}
    first, second, read = (
        whole_program.signature(ops[n], comps, shapes) for n in ("write", "write.1", "read")
    )
    assert first == second and first != read


def test_kernels_with_other_bodies_do_not_share_a_listing() -> None:
    """A causal and an unmasked kernel on the same shapes are two programs (their Mosaic
    bodies differ); the same body called twice is one."""
    comps = hlo.parse_computations(IN_PLACE_KERNEL)
    ops = {op.name: op for comp in comps.values() for op in comp.ops}
    shapes = {name: op.shape for name, op in ops.items()}
    read = ops["read"]
    same = dataclasses.replace(read, name="read.1")
    other = dataclasses.replace(read, name="read.2", attributes=read.attributes.replace(
        '"body": "x"', '"body": "y"'))  # fmt: skip
    first, twin, changed = (
        whole_program.signature(op, comps, shapes) for op in (read, same, other)
    )
    assert first == twin and first != changed


IN_PLACE_KERNEL = """HloModule m, entry_computation_layout={()->bf16[8,2,256,128]{3,2,1,0}}

ENTRY %main (cache: bf16[8,2,256,128], rows: bf16[8,2,128], blocks: s32[8], at: s32[8]) -> bf16[8,2,256,128] {
  %cache = bf16[8,2,256,128]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %rows = bf16[8,2,128]{2,1,0:T(2,128)(2,1)} parameter(1)
  %blocks = s32[8]{0:T(128)} parameter(2)
  %at = s32[8]{0:T(128)} parameter(3)
  %read = bf16[8,2,256,128]{3,2,1,0:T(8,128)(2,1)} custom-call(%blocks, %at, %rows, %cache), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "x", "cost_estimate": {"flops": "0", "transcendentals": "0", "bytes_accessed": "69632"}}}
  ROOT %write = bf16[8,2,256,128]{3,2,1,0:T(8,128)(2,1)} custom-call(%blocks, %at, %rows, %read), custom_call_target="tpu_custom_call", output_to_operand_aliasing={{}: (3, {})}, backend_config={"custom_call_config": {"body": "x", "cost_estimate": {"flops": "0", "transcendentals": "0", "bytes_accessed": "69632"}}}
}
"""


def test_a_kernel_updating_an_operand_in_place_moves_what_it_declares() -> None:
    comps = hlo.parse_computations(IN_PLACE_KERNEL)
    ops = {op.name: op for comp in comps.values() for op in comp.ops}
    shapes = {name: op.shape for name, op in ops.items()}
    assert op_bytes.op_hbm_bytes(ops["write"], comps, shapes) == 69632
    cache, rows, indices = 8 * 2 * 256 * 128 * 2, 8 * 2 * 128 * 2, 2 * 8 * 4
    assert op_bytes.op_hbm_bytes(ops["read"], comps, shapes) == 2 * cache + rows + indices


def test_a_program_s_ops_are_listed_in_the_order_of_its_text() -> None:
    """The sequential computations (a set) are walked in the text's order, so lists and sums
    over their ops come out the same in every process, whatever its hash seed."""
    found = whole_program.program_estimate(
        SCANNED, {}, lambda _: kernel_cost.FULL_GRID, TARGETS["v5e-4"], 4, sensitivity=False
    )
    order = [op.name for comp in hlo.parse_computations(SCANNED).values() for op in comp.ops]
    unmatched = found["ops_without_listing"]
    assert unmatched and unmatched == sorted(unmatched, key=order.index)
    assert {"next", "zero.copy"} <= set(unmatched)  # ops of the loop body and of the entry
