"""`estimate_program`: any program by reference, compiled in a worker and estimated whole."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest

from pallas_flash_estimate import (
    TARGETS,
    ImplausibleEstimateError,
    Target,
    UnknownGridError,
    estimate_program,
)
from pallas_flash_estimate.aot import worker
from pallas_flash_estimate.aot.devices import libtpu_version
from pallas_flash_estimate.aot.program_ref import ArraySpec, ProgramRef, parse_array
from pallas_flash_estimate.read import bundles

needs_libtpu = pytest.mark.skipif(libtpu_version() is None, reason="libtpu is not installed")


@pytest.fixture
def sample_programs(monkeypatch) -> types.ModuleType:
    """The programs of ``sample_programs.py`` beside this file, importable by name here and in
    the estimate's worker (which gets this process's ``sys.path``)."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    return importlib.import_module("sample_programs")


def _bf16(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


def test_a_reference_round_trips_through_json_and_binds_its_keywords(sample_programs) -> None:
    ref = ProgramRef.of(sample_programs.blocked_matmul, [_bf16(256, 512), _bf16(512, 128)],
                        {"bm": 128, "bn": 128})  # fmt: skip
    assert ref.function == "sample_programs:blocked_matmul"
    assert ref.args == (ArraySpec((256, 512), "bfloat16"), ArraySpec((512, 128), "bfloat16"))
    assert ProgramRef.from_json(ref.to_json()) == ref
    assert ref.resolve().keywords == {"bm": 128, "bn": 128}
    assert ref.label == "blocked_matmul(bfloat16[256, 512], bfloat16[512, 128], bm=128, bn=128)"


def test_a_jitted_function_is_named_by_the_function_it_wraps(sample_programs) -> None:
    ref = ProgramRef.of(jax.jit(sample_programs.plain_matmul), [_bf16(8, 128), _bf16(128, 8)])
    assert ref.function == "sample_programs:plain_matmul"


def test_a_function_another_process_cannot_import_is_refused_by_name(sample_programs) -> None:
    def local(x):
        return x

    with pytest.raises(ValueError, match="fn: expected a function defined at the top level"):
        ProgramRef.of(local, [_bf16(8, 128)])
    with pytest.raises(ValueError, match="fn: expected"):
        ProgramRef.of(lambda x: x, [_bf16(8, 128)])
    with pytest.raises(TypeError, match=r"args\[1\]: expected an abstract array"):
        ProgramRef.of(sample_programs.plain_matmul, [_bf16(8, 128), (8, 128)])


def test_an_unknown_target_is_refused_with_the_known_ones(sample_programs) -> None:
    with pytest.raises(ValueError, match=r"target: expected one of .*v5e-1"):
        estimate_program(sample_programs.plain_matmul, _bf16(8, 128), _bf16(128, 8), target="v9")


def test_array_arguments_are_read_from_their_dtype_and_shape() -> None:
    assert parse_array("bfloat16[4096, 4096]") == ArraySpec((4096, 4096), "bfloat16")
    assert parse_array("bf16[8,128]") == ArraySpec((8, 128), "bfloat16")
    assert parse_array("int32[]") == ArraySpec((), "int32")
    with pytest.raises(ValueError, match="unknown dtype 'bf17'"):
        parse_array("bf17[8]")
    with pytest.raises(ValueError, match=r"expected DTYPE\[D0,D1,...\]"):
        parse_array("4096x4096")


def test_a_target_round_trips_through_json() -> None:
    """Compared as JSON: a price not recorded is NaN (v7x), equal to itself only so."""
    for target in TARGETS.values():
        again = Target.from_json(json.loads(json.dumps(target.to_json())))
        assert json.dumps(again.to_json()) == json.dumps(target.to_json())
        assert dataclasses.replace(again, price_per_chip_hour=0) == dataclasses.replace(
            target, price_per_chip_hour=0
        )


@needs_libtpu
def test_a_user_s_own_target_is_compiled_for_and_divides_the_figures(sample_programs) -> None:
    """A `Target` that is not one of `TARGETS` (v5e at half its HBM bandwidth): estimated
    under its own name, a memory-bound program taking twice v5e's time."""
    half = dataclasses.replace(TARGETS["v5e-1"], name="v5e-1 at half bandwidth",
                               hbm_bandwidth=TARGETS["v5e-1"].hbm_bandwidth / 2)  # fmt: skip
    x = _bf16(4096, 4096)
    ours = estimate_program(sample_programs.doubled, x, target=half)
    v5e = estimate_program(sample_programs.doubled, x, target="v5e-1")
    assert ours.target == "v5e-1 at half bandwidth"
    assert ours.seconds == pytest.approx(2 * v5e.seconds, rel=0.05)


@needs_libtpu
def test_a_pallas_kernel_is_estimated_by_its_own_listing_and_grid(sample_programs) -> None:
    """A 1024 x 1024 x 1024 matmul on 512 x 512 output blocks: four grid steps, at least the
    MXU floor (2 x 1024³ flops at the target's peak), calibrated above it."""
    target = TARGETS["v5e-1"]
    x = _bf16(1024, 1024)
    found = estimate_program(sample_programs.blocked_matmul, x, x, bm=512, bn=512,
                             target="v5e-1")  # fmt: skip
    floor = 2 * 1024**3 / target.peak_flops
    assert found.grid_steps == 4
    assert floor <= found.seconds < 1.3 * floor
    assert found.seconds_by_kind["kernel"] == pytest.approx(found.seconds, rel=0.01)
    assert found.hbm["peak"] >= 3 * 1024 * 1024 * 2  # x, y and the output
    assert found.calibrated is not None and found.calibrated.seconds > found.seconds
    assert found.calibrated.kind == "MXU-bound" and found.calibrated.band is not None
    assert "blocked_matmul" in found.summary()


@needs_libtpu
def test_a_grid_sized_at_run_time_is_counted_from_the_program_s_constants(sample_programs):
    """A kernel whose grid's size and per-step work come from tables the program holds as
    constants (a block-sparse mask's): 64 grid steps, and the MXU-bound branch charged on the
    steps its table enables, so enabling every other step halves the kernel's time."""
    x = _bf16(64 * 256, 256)
    every = {n: estimate_program(sample_programs.sparse_blocks, x, every=n) for n in (1, 2)}
    assert every[1].grid_steps == every[2].grid_steps == 64
    kernel = {n: e.seconds_by_kind["kernel"] for n, e in every.items()}
    assert kernel[2] == pytest.approx(kernel[1] / 2, rel=0.05)


@needs_libtpu
def test_a_grid_sized_from_an_argument_is_unknown_unless_its_steps_are_given(sample_programs):
    """A grid sized from an argument's value: no figure but a named error saying what to
    give; given its steps, the same figure as the program that holds them as constants."""
    x, steps = _bf16(64 * 256, 256), jax.ShapeDtypeStruct((), jnp.int32)
    with pytest.raises(UnknownGridError, match=r"sparse_blocks\.1.*loop_trips=\{'sparse_blocks'"):
        estimate_program(sample_programs.sparse_blocks_given, x, steps)
    given = estimate_program(sample_programs.sparse_blocks_given, x, steps,
                             loop_trips={"sparse_blocks": (64,)})  # fmt: skip
    held = estimate_program(sample_programs.sparse_blocks, x, every=1)
    assert given.grid_steps == 64
    with pytest.raises(RuntimeError, match=r"loop_trips names \['sparse_block'\].*'sparse_blocks'"):
        estimate_program(sample_programs.sparse_blocks_given, x, steps,
                         loop_trips={"sparse_block": (64,)})  # fmt: skip
    kernel = held.seconds_by_kind["kernel"]
    assert given.seconds_by_kind["kernel"] == pytest.approx(kernel, rel=0.02)


@needs_libtpu
def test_loop_trips_its_flops_cannot_explain_give_no_figure(sample_programs):
    """The kernel declares the flops of raising its 64 blocks: its grid given as 1 step puts
    it under half of them at peak, as 4,096 puts its MXU work over 16 times them; either is
    refused by name, not returned as a figure."""
    x, steps = _bf16(64 * 256, 256), jax.ShapeDtypeStruct((), jnp.int32)
    for trips, said in (((1,), "too few times"), ((4096,), "too many times")):
        with pytest.raises(ImplausibleEstimateError, match=rf"sparse_blocks\.1: .*{said}"):
            estimate_program(sample_programs.sparse_blocks_given, x, steps,
                             loop_trips={"sparse_blocks": trips})  # fmt: skip


@needs_libtpu
def test_v6e_s_mxus_take_the_rows_its_compiler_schedules_them(sample_programs, tmp_path):
    """On v6e the compiler issues a 16-row bfloat16 vmatmul to one of its two 256-wide MXUs
    every 8 bundles where it keeps them busy: an MXU takes 2 rows a cycle, so the clock
    that gives v6e's 918 TFLOP/s is 1.75 GHz, not the 3.5 GHz that 1 row a cycle implies."""
    target = TARGETS["v6e"]
    assert target.mxu_rows_per_cycle == 2
    assert target.clock_hz == pytest.approx(target.peak_flops / (2 * 256 * 256 * 2 * 2))
    x = _bf16(1024, 1024)
    ref = ProgramRef.of(sample_programs.blocked_matmul, (x, x), {"bm": 512, "bn": 512})
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"program": ref.to_json(), "target": target.to_json()}))
    dump = tmp_path / "dump"
    env = worker.dump_env(dump) | {"PYTHONPATH": os.pathsep.join(sys.path)}
    args = [sys.executable, "-m", "pallas_flash_estimate.aot.worker", str(job), str(dump)]
    subprocess.run(args, env=env, check=True, capture_output=True)
    (listing,) = dump.glob("*-blocked_matmul.1-*-final_bundles.txt")
    issued = [b.index for b in bundles.scan_bundles(listing.read_text())
              if any(i.opcode.startswith("vmatmul") and i.opcode.endswith(".mxu0")
                     for i in b.instructions)]  # fmt: skip
    gaps = [b - a for a, b in itertools.pairwise(issued)]
    assert statistics.median(gaps) == 16 // target.mxu_rows_per_cycle


def test_a_worker_compiles_pallas_flash_kernels_as_mosaic(tmp_path) -> None:
    """The worker's environment asks for Mosaic kernels and the five dumped passes: on a host
    without a TPU, Pallas-Flash's kernels would otherwise trace as the interpreter's XLA ops
    (sends and receives, no kernel), which is not the program a TPU runs."""
    env = worker.dump_env(tmp_path, {"PALLAS_FLASH_INTERPRET": "1", "LIBTPU_INIT_ARGS": "--x"})
    assert env["PALLAS_FLASH_INTERPRET"] == "0"
    assert env["LIBTPU_INIT_ARGS"].startswith("--x --xla_jf_dump_to=")
    assert env["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"
    assert "PALLAS_FLASH_TPU" not in env


def test_a_worker_sizes_pallas_flash_kernels_for_the_target_s_generation(tmp_path) -> None:
    """estimate_program on v7x compiles Pallas-Flash's kernels at v7x's block sizes (its
    64 MiB of VMEM), not at v5e's, which the kernels assume off a TPU."""
    env = worker.dump_env(tmp_path, {"PALLAS_FLASH_TPU": "v5e"}, generation="v7x")
    assert env["PALLAS_FLASH_TPU"] == "v7x"
