"""`estimate_program`: any program by reference, compiled in a worker and estimated whole."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_flash_bench import calibration_programs, cli, estimate_program
from pallas_flash_bench.program_refs import ProgramRef, parse_array
from pallas_flash_bench.subjects import ArraySpec
from pallas_flash_estimate.targets import TARGETS


def _bf16(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


def test_a_reference_round_trips_through_json_and_binds_its_keywords() -> None:
    ref = ProgramRef.of(calibration_programs.guide_matmul, [_bf16(256, 512), _bf16(512, 128)],
                        {"bm": 128, "bk": 256, "bn": 128})  # fmt: skip
    assert ref.function == "pallas_flash_bench.calibration_programs:guide_matmul"
    assert ref.args == (ArraySpec((256, 512), "bfloat16"), ArraySpec((512, 128), "bfloat16"))
    assert ProgramRef.from_json(ref.to_json()) == ref
    assert ref.resolve().keywords == {"bm": 128, "bk": 256, "bn": 128}
    assert (
        ref.label == "guide_matmul(bfloat16[256, 512], bfloat16[512, 128], bk=256, bm=128, bn=128)"
    )


def test_a_function_another_process_cannot_import_is_refused_by_name() -> None:
    def local(x):
        return x

    with pytest.raises(ValueError, match="fn: expected a function defined at the top level"):
        ProgramRef.of(local, [_bf16(8, 128)])
    with pytest.raises(ValueError, match="fn: expected"):
        ProgramRef.of(lambda x: x, [_bf16(8, 128)])
    with pytest.raises(TypeError, match=r"args\[1\]: expected an abstract array"):
        ProgramRef.of(calibration_programs.xla_matmul, [_bf16(8, 128), (8, 128)])


def test_array_arguments_are_read_from_their_dtype_and_shape() -> None:
    assert parse_array("bfloat16[4096, 4096]") == ArraySpec((4096, 4096), "bfloat16")
    assert parse_array("bf16[8,128]") == ArraySpec((8, 128), "bfloat16")
    assert parse_array("int32[]") == ArraySpec((), "int32")
    with pytest.raises(ValueError, match="unknown dtype 'bf17'"):
        parse_array("bf17[8]")
    with pytest.raises(ValueError, match=r"expected DTYPE\[D0,D1,...\]"):
        parse_array("4096x4096")


def test_the_cli_names_what_is_wrong_with_its_arguments(capsys) -> None:
    with pytest.raises(SystemExit, match="--kwarg: expected NAME=VALUE"):
        cli.main(["estimate", "pallas_flash_bench.calibration_programs:xla_matmul",
                  "--arg", "bf16[8,128]", "--kwarg", "bm"])  # fmt: skip
    with pytest.raises(SystemExit, match="has no attribute 'nope'"):
        cli.main(["estimate", "pallas_flash_bench.calibration_programs:nope"])


def test_a_pallas_kernel_is_estimated_by_its_own_listing_and_grid() -> None:
    """The matmul guide's kernel at 1024³ with 512 x 1024 x 1024 blocks: two grid steps, at
    least the MXU floor (2 x 1024³ flops at 197 TFLOP/s), calibrated above it."""
    target = TARGETS["v5e-1"]
    x = _bf16(1024, 1024)
    found = estimate_program(calibration_programs.guide_matmul, x, x, bm=512, bk=1024, bn=1024,
                             target="v5e-1")  # fmt: skip
    floor = 2 * 1024**3 / target.peak_flops
    assert found.grid_steps == 2
    assert floor <= found.seconds < 1.2 * floor
    assert found.seconds_by_kind["kernel"] == pytest.approx(found.seconds, rel=0.01)
    assert found.hbm["peak"] >= 3 * 1024 * 1024 * 2  # x, y and the output
    assert found.calibrated is not None and found.calibrated.seconds > found.seconds
    assert found.calibrated.kind == "MXU-bound" and found.calibrated.band is not None
    assert "guide_matmul" in found.summary()
