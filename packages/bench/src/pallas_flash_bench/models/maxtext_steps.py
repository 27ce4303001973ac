"""MaxText's own train step, compiled by MaxText's AOT path for a v5e slice and estimated by
the same whole-program estimator as ours: the calibration point behind MaxText's published
v5e table, and the program our model rows are held against.

Two stages, in two environments:

- ``compile`` (Python 3.12 with maxtext installed: ``scripts/nox -s maxtext``): MaxText's
  ``train_compile.main`` on the config of its v5e script, with the script's XLA flags, the
  LLO dump on, and the compiled program's HLO text saved (`compile_step`);
- ``estimate`` (any environment with this package): the saved HLO and dump estimated whole
  (`whole_program`; MaxText's attention is splash, its kernels charged causally), written as
  a JSON analysis (`estimate_step`), which the calibration reads (`calibration_points`).

Run: ``python -m pallas_flash_bench.models.maxtext_steps {compile,estimate} --config 16b --work DIR
[--out FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys

MAXTEXT_VERSION = "0.2.4"
"""The maxtext the compile stage was written against (`nox -s maxtext` installs it)."""

SCRIPT_FLAGS = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true "
    "--xla_tpu_data_parallel_opt_different_sized_ops=true "
    "--xla_tpu_enable_async_collective_fusion=true "
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
    "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
)
"""The libtpu flags MaxText's v5e scripts (``configs/tpu/v5e/*.sh``) set."""


@dataclasses.dataclass(frozen=True)
class MaxTextStep:
    """One of MaxText's v5e training configurations: the ``train_compile`` arguments of its
    script, the model's shape (for the flop count) and the published MFU (None where MaxText
    ships the script without one: the step is then a reference program, not a calibration
    point).

    The MFU was measured with MaxText's flop count of the time, causal attention not halved
    (MaxText halves it now, as we do): the step time it implies is that count over the MFU
    times the peak (`published_step_seconds`)."""

    name: str
    topology: str
    arguments: tuple[str, ...]
    vocab: int
    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    batch_per_chip: int
    seq_len: int
    published_mfu: float | None
    source: str

    def step_flops(self, causal_halved: bool = True) -> float:
        """One chip's flops per step (`model_flops.train_step_flops` on its shape)."""
        from pallas_flash_bench.models import model_flops

        return model_flops.train_step_flops(self, self.batch_per_chip, self.seq_len,
                                            causal_halved)  # fmt: skip

    def published_step_seconds(self, peak_flops: float) -> float | None:
        """The step time the published MFU implies, with the flop count it was measured by."""
        if self.published_mfu is None:
            return None
        return self.step_flops(causal_halved=False) / (self.published_mfu * peak_flops)


SHAPE_FIELDS = ("vocab", "hidden", "layers", "q_heads", "kv_heads", "head_dim", "mlp")
"""The fields of `MaxTextStep` that give the model's shape (a `LlamaConfig`'s, by name)."""

STEPS = {
    "16b": MaxTextStep(
        name="MaxText 16B train step (v5e-256)",
        topology="v5e-256",
        arguments=(
            "steps=15",
            "per_device_batch_size=6",
            "enable_checkpointing=false",
            "remat_policy=full",
            "global_parameter_scale=16",
            "max_target_length=2048",
            "use_iota_embed=true",
            "reuse_example_batch=1",
            "dataset_type=synthetic",
            "attention=flash",
        ),
        vocab=32000,
        hidden=4096,
        layers=32,
        q_heads=64,
        kv_heads=64,
        head_dim=128,
        mlp=28672,
        batch_per_chip=6,
        seq_len=2048,
        published_mfu=0.6110,
        source="MaxText's README, v5e-256 table (16B, seq 2048: 61.10 % MFU), measured with "
        "configs/tpu/v5e/16b.sh; its flop count then did not halve causal attention",
    ),
    "llama2-7b": MaxTextStep(
        name="MaxText Llama-2-7B train step (v5e-256)",
        topology="v5e-256",
        arguments=(
            "model_name=llama2-7b",
            "per_device_batch_size=4",
            "remat_policy=save_qkv_proj",
            "steps=15",
            "enable_checkpointing=false",
            "use_iota_embed=true",
            "dataset_type=synthetic",
        ),
        vocab=32000,
        hidden=4096,
        layers=32,
        q_heads=32,
        kv_heads=32,
        head_dim=128,
        mlp=11008,
        batch_per_chip=4,
        seq_len=2048,
        published_mfu=None,
        source="MaxText's configs/tpu/v5e/llama2_7b.sh (v5e-256; no published MFU)",
    ),
}
"""MaxText's v5e configurations this module compiles, by name."""


def data_file(name: str) -> str:
    """The package data file holding the committed analysis of ``STEPS[name]``."""
    return f"maxtext-{name}-{STEPS[name].topology}.json"


def committed(name: str) -> dict | None:
    """The committed analysis (`estimate_step`) of ``STEPS[name]``, or None."""
    return load_committed(data_file(name))


def load_committed(file: str) -> dict | None:
    """A committed analysis of MaxText's programs, ``file`` in the package's data folder, or
    None where it is not there."""
    import importlib.resources

    path = importlib.resources.files("pallas_flash_bench") / "data" / file
    return json.loads(path.read_text()) if path.is_file() else None


def analysis_versions() -> dict[str, str | None]:
    """What an analysis of MaxText's programs was made with: maxtext, libtpu and jax."""
    import importlib.metadata

    from pallas_flash_estimate.aot.devices import libtpu_version

    return {"maxtext": MAXTEXT_VERSION, "libtpu": libtpu_version(),
            "jax": importlib.metadata.version("jax")}  # fmt: skip


def compile_step(step: MaxTextStep, work: pathlib.Path) -> None:
    """MaxText's ``train_compile`` for ``step`` with the LLO dump in ``work/dump`` and the
    compiled HLO text in ``work/step.hlo.txt``. Sets libtpu's flags before jax starts: run
    it in a fresh process."""
    from pallas_flash_estimate.read import dump_files

    dump = work / "dump"
    dump.mkdir(parents=True, exist_ok=True)
    os.environ["LIBTPU_INIT_ARGS"] = f"{SCRIPT_FLAGS} {dump_files.dump_flags(dump)}"
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    import importlib.resources

    from absl import app
    from maxtext.trainers.pre_train import train_compile

    original = train_compile.jit_and_compile

    def jit_and_compile(*args, **kwargs):  # keeps the compiled program's text
        compiled = original(*args, **kwargs)
        (work / "step.hlo.txt").write_text(compiled.as_text())
        return compiled

    train_compile.jit_and_compile = jit_and_compile
    base = importlib.resources.files("maxtext") / "configs" / "base.yml"
    argv = ["train_compile", str(base), "run_name=pallas-flash-calibration",
            f"base_output_directory={work / 'out'}", f"compile_topology={step.topology}",
            "compile_topology_num_slices=1", *step.arguments]  # fmt: skip
    app.run(train_compile.main, argv=argv)  # exits when MaxText's main returns


def estimate_step(step: MaxTextStep, work: pathlib.Path) -> dict:
    """The analysis of a compiled step (`compile_step`'s files): its whole-program estimate
    on one chip of the slice, and the published measurement it is held against."""
    from pallas_flash_estimate.cost import kernel_cost, llo
    from pallas_flash_estimate.program import whole_program
    from pallas_flash_estimate.targets import TARGETS

    target = TARGETS[step.topology]
    schedules = llo.load_dump(work / "dump", target.mxu_rows_per_cycle)
    occupancy = kernel_cost.FullGrid(causal=True)  # splash's blocks above the diagonal skipped
    found = whole_program.program_estimate(
        (work / "step.hlo.txt").read_text(), schedules, lambda _: occupancy, target,
        target.chips,
    )  # fmt: skip
    return {
        "name": step.name,
        "step": dataclasses.asdict(step),
        "estimate": found,
        "measured_seconds": step.published_step_seconds(target.peak_flops),
        "flops_per_chip": step.step_flops(),
        "analysis": whole_program.ANALYSIS_VERSION,
        "versions": analysis_versions(),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_flash_bench.models.maxtext_steps")
    parser.add_argument("stage", choices=("compile", "estimate"))
    parser.add_argument("--config", choices=sorted(STEPS), default="16b")
    parser.add_argument("--work", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, help="estimate: the analysis's JSON file")
    args = parser.parse_args(argv)
    step = STEPS[args.config]
    if args.stage == "compile":
        compile_step(step, args.work)
        return 0
    analysis = estimate_step(step, args.work)
    text = json.dumps(analysis, indent=1) + "\n"
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
