"""Tests of the optimized-HLO reader on real ``compiled.as_text()`` samples (tests/samples/hlo,
Mosaic kernel bodies trimmed) and small hand-written modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from pallas_flash_estimate.read import hlo, hlo_ops

SAMPLES = Path(__file__).parent / "samples" / "hlo"
FLASH = (SAMPLES / "flash_noncausal.txt").read_text()
SPLASH = (SAMPLES / "splash_causal_fwd_bwd.txt").read_text()
DENSE = (SAMPLES / "xla_dense_transpose.txt").read_text()

MiB = 1 << 20


def test_shape_bytes():
    assert hlo.shape_bytes("bf16[1,16,4096,128]{3,2,1,0:T(8,128)(2,1)}") == 16 * MiB
    assert hlo.shape_bytes("f32[]{:T(128)}") == 4
    assert hlo.shape_bytes("pred[2048,2048]{0,1:T(8,128)(4,1)S(1)}") == 4 * MiB
    assert hlo.shape_bytes("(s8[1,4,4]{2,1,0:T(4,128)(4,1)S(1)}, u32[]{:S(2)})") == 16 + 4
    assert hlo.shape_bytes("((f32[2,3]), s64[5], f64[], s4[3])") == 24 + 40 + 8 + 2
    assert hlo.shape_bytes("token[]") == 0


def test_parse_entry_flash():
    ops = hlo.parse_entry(FLASH)
    assert [(op.name, op.opcode) for op in ops] == [
        ("v.1", "parameter"),
        ("k.1", "parameter"),
        ("q.1", "parameter"),
        ("flash_attention.1", "custom-call"),
    ]
    kernel = ops[-1]
    assert kernel.bytes == 16 * MiB and kernel.operands == ("q.1", "k.1", "v.1")
    assert kernel.shape == "bf16[1,16,4096,128]{3,2,1,0:T(8,128)(2,1)}"
    assert kernel.detail == "tpu_custom_call" and kernel.computation == "main.2"
    assert hlo_ops.find_copy_trap(FLASH) == []
    assert [op.name for op in hlo_ops.kernel_calls(FLASH)] == ["flash_attention.1"]
    assert hlo_ops.cost_estimate(kernel) == {
        "flops": 137975824384,
        "transcendentals": 268435456,
        "bytes_accessed": 67108864,
        "remote_bytes_transferred": 0,
    }


def test_splash_entry_multiline_instructions_and_kernels():
    comps = hlo.parse_computations(SPLASH)
    assert list(comps) == [
        "fused_computation.3",
        "scalar_add_computation",
        "fused_computation",
        "fused_computation.1",
        "main.3",
    ]
    ops = hlo.parse_entry(SPLASH)
    assert len(ops) == 61 and ops[-1].opcode == "tuple"
    by_name = {op.name: op for op in ops}
    # spans three lines (frontend attributes with a multi-line string); tuple: sum of elements
    fwd = by_name["splash_mha_fwd_residuals.1"]
    assert fwd.bytes == 3 * 512 * 128 * 4 + 4 * 2048 * 128 * 2 + 4 * 2048 * 128 * 4
    assert fwd.operands == ("constant.6", "constant.7", "q.1", "k.1", "v.1", "iota.1")
    assert by_name["constant.6"].operands == ()
    assert by_name["custom-call"].detail == "ConcatBitcast"
    assert by_name["fusion"].detail == "kind=kLoop calls=%fused_computation.3"
    kernels = hlo_ops.kernel_calls(SPLASH)
    assert [k.name for k in kernels] == [
        "splash_mha_fwd_residuals.1",
        "splash_mha_dkv_no_residuals.1",
        "splash_mha_dq_no_residuals.1",
    ]
    assert hlo_ops.cost_estimate(kernels[0]) is None  # splash declares none


def test_splash_copy_trap():
    trap = hlo_ops.find_copy_trap(SPLASH)
    got = [(op.name, op.opcode, op.bytes, op.relayout) for op in trap]
    assert got == [
        ("copy", "copy", 4 * 2048 * 128 * 4, True),
        ("copy_bitcast_fusion", "fusion", 4 * 2048 * 4, True),
        ("copy-start.1", "copy-start", 16, False),
        ("copy-start.2", "copy-start", 16, False),
        ("copy-start", "copy-start", 16, False),
    ]
    assert (
        trap[0].detail == "relayout {2,1,0:T(8,128)} -> {1,2,0:T(8,128)}"  # both in VMEM, S(1)
    )
    assert trap[1].detail.startswith(
        "kind=kLoop calls=%fused_computation.1: copy %copy.2 (relayout"
    )
    # a copy-start is counted once with its copy-done, by the copied data (not the tuple)
    assert trap[2].shape == "s8[1,4,4]{2,1,0:T(4,128)(4,1)S(1)}"
    assert trap[2].detail == "memory space S(0) -> S(1); async pair with %copy-done.1"
    assert not [op for op in trap if op.opcode == "copy-done"]


def test_dense_transposed_layout_copy_trap():
    trap = hlo_ops.find_copy_trap(DENSE)
    got = [(op.name, op.opcode, op.bytes, op.relayout) for op in trap]
    assert got == [
        ("copy-start", "copy-start", 2 * MiB, False),
        ("copy-start.1", "copy-start", 2 * MiB, False),
        ("copy-start.2", "copy-start", 2 * MiB, False),
        ("copy.2", "copy", 2 * MiB, True),
    ]
    assert trap[0].detail.endswith("cross-program prefetch")
    assert trap[3].detail == (
        "relayout {2,3,1,0:T(8,128)(2,1)} -> {3,2,1,0:T(8,128)(2,1)}, memory space S(1) -> S(0)"
    )
    assert sum(op.bytes for op in trap if op.relayout) == 2 * MiB
    assert hlo_ops.kernel_calls(DENSE) == []
    entry = hlo.parse_entry(DENSE)
    assert entry[-1].name == "copy.2" and entry[-1].operands == ("fusion.9",)


TOY = """\
HloModule toy, entry_computation_layout={(f32[8,128]{1,0})->f32[128,16]{1,0}}

%inner (p.0: f32[8,128]) -> f32[128,8] {
  %p.0 = f32[8,128]{1,0} parameter(0)
  ROOT %t.0 = f32[128,8]{1,0} transpose(%p.0), dimensions={1,0}
}

%outer (p.1: f32[8,128]) -> f32[128,8] {
  %p.1 = f32[8,128]{1,0} parameter(0)
  ROOT %f.0 = f32[128,8]{1,0} fusion(%p.1), kind=kLoop, calls=%inner
}

%body (p.2: f32[8,128]) -> f32[8,128] {
  %p.2 = f32[8,128]{1,0} parameter(0)
  ROOT %k.0 = f32[8,128]{1,0} custom-call(%p.2), custom_call_target="tpu_custom_call"
}

ENTRY %main (x: f32[8,128]) -> f32[128,16] {
  %x = f32[8,128]{1,0} parameter(0)
  %c = f32[8,128]{0,1} copy(%x)
  %t = f32[128,8]{1,0} transpose(%x), dimensions={1,0}
  %z = f32[] constant(0)
  %p = f32[128,16]{1,0} pad(%t, %z), padding=0_0x0_8
  %f = f32[128,8]{1,0} fusion(%x), kind=kLoop, calls=%outer
  %d = f32[8,128]{1,0} copy-done(%x)
  %k = f32[8,128]{1,0} custom-call(%c), custom_call_target="tpu_custom_call"
  ROOT %w = f32[8,128]{1,0} call(%k), to_apply=%body
}
"""


def test_toy_module_every_kind_of_copy():
    trap = hlo_ops.find_copy_trap(TOY)
    got = [(op.name, op.opcode, op.bytes, op.relayout, op.detail) for op in trap]
    assert got == [
        ("c", "copy", 4096, True, "relayout {1,0} -> {0,1}"),
        ("t", "transpose", 4096, True, "dimensions={1,0}"),
        ("p", "pad", 8192, True, "padding=0_0x0_8"),
        ("f", "fusion", 4096, True, "kind=kLoop calls=%outer: transpose %t.0"),
        ("d", "copy-done", 4096, False, "same layout and memory space"),
    ]
    # kernels of the entry first, then those in other computations (here a called body)
    assert [(k.name, k.computation) for k in hlo_ops.kernel_calls(TOY)] == [
        ("k", "main"),
        ("k.0", "body"),
    ]


BITCAST_TOY = """\
HloModule bitcast, entry_computation_layout={(bf16[1,64,2,128]{3,2,1,0})->bf16[1,2,64,128]{3,2,1,0}}

ENTRY %main (q: bf16[1,64,2,128]) -> bf16[1,2,64,128] {
  %q = bf16[1,64,2,128]{3,2,1,0} parameter(0)
  %copy.2 = bf16[1,64,2,128]{3,1,2,0} copy(%q)
  %bitcast.3 = bf16[1,2,64,128]{3,2,1,0} bitcast(%copy.2)
  %bitcast.4 = bf16[1,2,64,128]{3,2,1,0} bitcast(%q)
  ROOT %k = bf16[1,2,64,128]{3,2,1,0} custom-call(%bitcast.3, %bitcast.4),
    custom_call_target="tpu_custom_call"
}
"""


def test_a_kernel_operand_copied_behind_a_bitcast_is_found():
    """jax 0.12's XLA transposes q for a kernel by a copy into the transposed layout and a
    bitcast to the kernel's shape; a bitcast of the parameter itself copies nothing."""
    found = hlo_ops.kernel_operand_copies(BITCAST_TOY)
    assert [(call.name, producer.name) for call, producer in found] == [("k", "copy.2")]


SPARSECORE_TOY = """\
HloModule sparsecore

%called_computation (p: bf16[64,128]) -> bf16[64,128] {
  %p = bf16[64,128]{1,0} parameter(0)
  ROOT %c = bf16[64,128]{0,1} copy(%p)
}, execution_thread="sparsecore"

ENTRY %main (x: bf16[64,128]) -> bf16[64,128] {
  %x = bf16[64,128]{1,0} parameter(0)
  %s = ((bf16[64,128]{1,0}), bf16[64,128]{0,1}, u32[]) call-start(%x),
    async_execution_thread="sparsecore", to_apply=%called_computation
  ROOT %d = bf16[64,128]{0,1} call-done(%s)
}
"""


def test_a_computation_closed_with_attributes_ends_there():
    """v7x's compiler offloads relayouts to the SparseCore, in computations closed by
    ``}, execution_thread="sparsecore"``: the entry after them is still found."""
    comps = hlo.parse_computations(SPARSECORE_TOY)
    assert list(comps) == ["called_computation", "main"]
    assert [op.name for op in comps["called_computation"].ops] == ["p", "c"]
    assert [op.opcode for op in hlo.parse_entry(SPARSECORE_TOY)] == [
        "parameter",
        "call-start",
        "call-done",
    ]


def test_no_entry_computation():
    with pytest.raises(ValueError, match="ENTRY"):
        hlo.parse_entry("HloModule empty\n")


COLLECTIVE_TOY = """HloModule collectives

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[1,32,128], m: f32[1,32]) -> f32[4,32,128] {
  %x = f32[1,32,128]{2,1,0} parameter(0)
  %m = f32[1,32]{1,0} parameter(1)
  %pmax = f32[1,32]{1,0} all-reduce(%m), replica_groups={{0,1,2,3}}, to_apply=%sum
  %psum = (f32[1,32,128]{2,1,0}, f32[1,32]{1,0}) all-reduce(%x, %pmax), to_apply=%sum
  %y = f32[1,32,128]{2,1,0} get-tuple-element(%psum), index=0
  %ag = f32[4,32,128]{2,1,0} all-gather-start(%y), dimensions={0}
  ROOT %agd = f32[4,32,128]{2,1,0} all-gather-done(%ag)
}
"""


def test_collectives_in_program_order_with_their_bytes():
    got = [(op.name, op.opcode, op.bytes) for op in hlo_ops.collectives(COLLECTIVE_TOY)]
    assert got == [
        ("pmax", "all-reduce", 32 * 4),
        ("psum", "all-reduce", (32 * 128 + 32) * 4),
        ("ag", "all-gather-start", 4 * 32 * 128 * 4),  # the pair counts once
    ]
    assert hlo_ops.collectives(TOY) == []


CONDITIONAL_TOY = """HloModule conditional

%second (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %rest = f32[8]{0} custom-call(%p), custom_call_target="tpu_custom_call"
}

%nothing (z: f32[8]) -> f32[8] {
  ROOT %z = f32[8]{0} parameter(0)
}

ENTRY %main (x: f32[8], b: pred[]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %b = pred[] parameter(1)
  %first = f32[8]{0} custom-call(%x), custom_call_target="tpu_custom_call"
  ROOT %c = f32[8]{0} conditional(%b, %first, %first), branch_computations={%nothing, %second}
}
"""


def test_kernels_in_a_conditional_branch_are_told_apart():
    assert [op.name for op in hlo_ops.kernel_calls(CONDITIONAL_TOY)] == ["first", "rest"]
    assert hlo_ops.conditional_kernel_calls(CONDITIONAL_TOY) == {"rest"}
    assert hlo_ops.conditional_kernel_calls(TOY) == set()


TWINS = """HloModule twins

ENTRY %main (k: bf16[64,128], v: bf16[64,128]) -> (bf16[64,128], bf16[64,128], f32[8,128]) {
  %k = bf16[64,128]{1,0} parameter(0)
  %v = bf16[64,128]{1,0} parameter(1)
  %write.2 = bf16[64,128]{1,0} custom-call(%k), custom_call_target="tpu_custom_call", backend_config={"body":"AAA"}, metadata={op_name="jit(step)/write" stack_frame_id=7}
  %write.3 = bf16[64,128]{1,0} custom-call(%v), custom_call_target="tpu_custom_call", backend_config={"body":"AAA"}, metadata={op_name="jit(step)/write" stack_frame_id=9}
  %other = bf16[64,128]{1,0} custom-call(%v), custom_call_target="tpu_custom_call", backend_config={"body":"BBB"}
  %small = f32[8,128]{1,0} custom-call(%k), custom_call_target="tpu_custom_call", backend_config={"body":"AAA"}
  ROOT %t = (bf16[64,128]{1,0}, bf16[64,128]{1,0}, f32[8,128]{1,0}) tuple(%write.3, %other, %small)
}
"""  # noqa: E501


def test_a_kernel_call_without_a_dump_of_its_own_runs_its_identical_twins_schedule():
    calls = hlo_ops.kernel_calls(TWINS)
    assert [op.name for op in calls] == ["write.2", "write.3", "other", "small"]
    # the same body on the same shape, whatever its source metadata; not another body or shape
    assert hlo_ops.kernel_twins(calls, {"write.2"}) == {"write.3": "write.2"}
    assert hlo_ops.kernel_twins(calls, {"write.2", "write.3", "other", "small"}) == {}


CONSTANT_OPERANDS = """\
HloModule sparse, entry_computation_layout={(bf16[64,128]{1,0})->bf16[64,128]{1,0}}

ENTRY %main (x: bf16[64,128]) -> bf16[64,128] {
  %x = bf16[64,128]{1,0} parameter(0)
  %steps = s32[]{:T(128)} constant(4)
  %table = s32[4]{0:T(1024)} constant({1, 0, 1, 1})
  %start = (s32[4]{0:T(1024)S(1)}, s32[4]{0:T(1024)}, u32[]{:S(2)}) copy-start(%table)
  %done = s32[4]{0:T(1024)S(1)} copy-done(%start)
  %grid = s32[2,2]{1,0} constant({ { 1, 2 }, { 3, 4 } })
  %scale = f32[] constant(0.5)
  ROOT %k = bf16[64,128]{1,0} custom-call(%steps, %done, %grid, %scale, %x),
    custom_call_target="tpu_custom_call"
}
"""


def test_a_kernel_s_integer_constant_operands_are_read_through_a_move_into_vmem():
    """A dynamic grid's size (a scalar) and a mask's block table (one dimension, moved into
    VMEM by a copy-start/copy-done pair) are read; a two-dimensional table (its words lie in
    the kernel's memory in tiles), a float and a parameter are not."""
    assert hlo_ops.kernel_constant_operands(CONSTANT_OPERANDS) == {"k": {0: 4, 1: (1, 0, 1, 1)}}
    ops = {op.name: op for op in hlo.parse_entry(CONSTANT_OPERANDS)}
    assert hlo.integer_constant(ops["grid"]) == (1, 2, 3, 4)  # row-major, as printed
    assert hlo.integer_constant(ops["scale"]) is None and ops["scale"].detail == ""
    assert hlo.integer_constant(ops["x"]) is None
