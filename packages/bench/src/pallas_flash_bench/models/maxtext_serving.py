"""MaxText's own inference engine (``MaxEngine``: prefill, insert, generate), compiled ahead of
time for a v5e slice at JetStream-MaxText's published settings and estimated by the same
whole-program estimator as ours: the reference serving program, as `maxtext_steps` is the
reference train step.

Two stages, in two environments:

- ``compile`` (Python 3.12 with maxtext: ``scripts/nox -s maxtext-serving``): MaxText's
  config for the reference, the slice's devices from its *topology* (no TPU: as
  ``train_compile`` builds its mesh), a ``MaxEngine`` on them whose parameters are abstract
  (`_abstract_decode_state`), and each program lowered on ``jax.ShapeDtypeStruct``\\ s with
  their shardings and compiled, in a process of its own (libtpu reads its dump flag once):
  its HLO text in ``work/PROGRAM/program.hlo.txt``, its LLO dump in ``work/PROGRAM/dump``,
  its memory analysis in ``work/PROGRAM/memory.json`` (`compile_program`);
- ``estimate`` (any environment with this package): each program estimated whole
  (`whole_program`) and the run's output tokens/s derived (`tokens_per_second`), written as
  a JSON analysis (`estimate_serving`).

Run: ``python -m pallas_flash_bench.models.maxtext_serving {compile,estimate} --work DIR [--out
FILE]`` (``compile --program NAME`` compiles one program in this process).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

from pallas_flash_bench.models.maxtext_steps import analysis_versions, load_committed
from pallas_flash_estimate.cost import kernel_cost
from pallas_flash_estimate.read import dump_files

PROGRAMS = ("generate", "prefill", "insert")
"""MaxEngine's programs a served request runs: its prompt's prefill, the prefix's insert into
the decode state, and the whole batch's decode steps (each ``generate`` one token for each)."""


@dataclasses.dataclass(frozen=True)
class ServingReference:
    """JetStream-MaxText's published serving configuration: MaxText's arguments (its server's
    flags), the batch, the lengths a run is charged at, and the published throughput."""

    name: str
    topology: str
    arguments: tuple[str, ...]
    batch_per_chip: int
    prompt_length: int
    generate_length: int
    published_tokens_per_second: float
    source: str
    deviations: str


SERVING = {
    "llama2-7b": ServingReference(
        name="JetStream-MaxText Llama-2-7B bf16 serving (v5e-8)",
        topology="v5e-8",
        arguments=(
            "model_name=llama2-7b",
            "tokenizer_path=assets/tokenizer.llama2",
            "max_prefill_predict_length=1024",
            "max_target_length=2048",
            "ici_fsdp_parallelism=1",
            "ici_autoregressive_parallelism=1",
            "ici_tensor_parallelism=-1",
            "scan_layers=false",
            "weight_dtype=bfloat16",
            "per_device_batch_size=11",
            "pure_nnx=false",
            "pure_nnx_decoder=false",
        ),
        batch_per_chip=11,
        prompt_length=1024,
        generate_length=1024,
        published_tokens_per_second=3061.78,
        source="AI-Hypercomputer/tpu-recipes inference/v5e/JetStream-Maxtext/Llama2-7B/"
        "README.md (commit 5ba55c8): MaxText.maxengine_server with these flags (bf16 "
        "weights and KV cache, no quantization), JetStream benchmark_serving.py on "
        "openorca, 1000 prompts, max-output-length 1024, no request-rate cap; its example "
        "output: 995 requests, 217011 input and 934964 generated tokens in 305.37 s, "
        "'Output token throughput: 3061.78 tokens/s'",
        deviations="maxtext 0.2.4, not the main branch of the recipe's day; its Linen model "
        "(pure_nnx=false), as that MaxText's; parameters abstract, not loaded; programs "
        "jitted as the server calls them (default layouts, not the microbenchmark's "
        "AUTO-layout generate); no libtpu flags but the dump's; fixed lengths (every prompt "
        "prefilled at 1024, 1024 generated), not openorca's (mean 218 in, 940 out, "
        "prompts padded to power-of-two buckets)",
    ),
}
"""The published serving references this module compiles, by name."""


def data_file(name: str) -> str:
    """The package data file holding the committed analysis of ``SERVING[name]``."""
    return f"maxtext-serving-{name}-{SERVING[name].topology}.json"


def committed(name: str) -> dict | None:
    """The committed analysis (`estimate_serving`) of ``SERVING[name]``, or None."""
    return load_committed(data_file(name))


def tokens_per_second(batch: int, generated: int, generate_s: float, prefill_s: float,
                      insert_s: float) -> float:  # fmt: skip
    """Output tokens/s of a run of ``batch`` sequences, each prefilled once and inserted once,
    then ``generated`` decode steps of the whole batch: ``B * G / (G * t_generate + B *
    (t_prefill + t_insert))``."""
    return batch * generated / (generated * generate_s + batch * (prefill_s + insert_s))


def _abstract_decode_state(config: object, mesh: object, checkpoint_manager: object,
                           init_state_fn: object) -> tuple:  # fmt: skip
    """MaxText's ``setup_decode_state`` without weights: the state's shapes and shardings
    (``get_abstract_state``), so that ``MaxEngine.load_params`` returns abstract params."""
    from maxtext.utils import maxtext_utils

    state, annotations, _ = maxtext_utils.get_abstract_state(config, mesh, init_state_fn, False)
    return state, annotations


def _stub_results_as_pytree(engine_api: object) -> None:
    """JetStream's ``ResultTokens`` as a pytree (JetStream's own is a flax struct: its arrays
    children, its indices static) where maxtext stubs it, JetStream not installed."""
    import jax

    if not getattr(engine_api, "_IS_STUB", False):
        return
    result = engine_api.ResultTokens
    static = ("tokens_idx", "valid_idx", "length_idx", "samples_per_slot")

    def unflatten(aux: tuple, kids: tuple) -> object:
        return result(data=kids[0], log_prob=kids[1], **dict(zip(static, aux, strict=True)))

    jax.tree_util.register_pytree_node(
        result, lambda r: ((r.data, r.log_prob), tuple(getattr(r, f) for f in static)), unflatten
    )


def compile_program(ref: ServingReference, program: str, work: pathlib.Path) -> None:
    """MaxEngine's ``program`` for ``ref`` compiled on the slice's topology: its HLO text,
    LLO dump and memory analysis in ``work/program``. Sets libtpu's flags before jax starts:
    run it in a fresh process."""
    out = work / program
    (out / "dump").mkdir(parents=True, exist_ok=True)
    os.environ["LIBTPU_INIT_ARGS"] = dump_files.dump_flags(out / "dump")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # JetStream's API stubbed: not installed
    import importlib.resources

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    from maxtext.configs import pyconfig
    from maxtext.inference.maxengine import maxengine
    from maxtext.trainers.pre_train import train_compile
    from maxtext.utils import maxtext_utils

    base = importlib.resources.files("maxtext") / "configs" / "base.yml"
    config = pyconfig.initialize(["maxengine", str(base), "run_name=pallas-flash-serving",
                                  f"base_output_directory={work / 'out'}",
                                  f"compile_topology={ref.topology}",
                                  "compile_topology_num_slices=1", *ref.arguments])  # fmt: skip
    mesh = train_compile.get_topology_mesh(config)
    _stub_results_as_pytree(maxengine.engine_api)
    maxtext_utils.setup_decode_state = _abstract_decode_state
    engine = maxengine.MaxEngine(config, devices=list(mesh.devices.flat))
    params = engine.load_params()
    engine.abstract_params = params  # load_params keeps only concrete arrays' shapes
    replicated = NamedSharding(engine.mesh, PartitionSpec())

    def shaped(shape: tuple[int, ...], dtype: object) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    rng = shaped(key.shape, key.dtype)
    tokens, scalar = shaped((ref.prompt_length,), jnp.int32), shaped((), jnp.int32)

    def prefill(params: object, tokens: object, true_length: object, rng: object) -> tuple:
        return engine.prefill_aot(params, tokens, true_length, rng)

    if program == "prefill":
        lowered = jax.jit(prefill).lower(params, tokens, scalar, rng)
    else:
        state = jax.eval_shape(engine.init_decode_state)  # sharded as the engine's
        if program == "generate":
            lowered = jax.jit(engine.generate_aot, donate_argnums=(1,)).lower(params, state, rng)
        else:
            prefix = jax.eval_shape(prefill, params, tokens, scalar, rng)[0]
            lowered = jax.jit(engine.insert, donate_argnums=(1,)).lower(prefix, state, scalar)
    compiled = lowered.compile()
    (out / "program.hlo.txt").write_text(compiled.as_text())
    memory = compiled.memory_analysis()
    fields = ("argument", "output", "alias", "temp", "generated_code")
    sizes = {f: int(getattr(memory, f"{f}_size_in_bytes", 0)) for f in fields}
    sizes["peak"] = sizes["argument"] + sizes["output"] + sizes["temp"] - sizes["alias"]
    (out / "memory.json").write_text(json.dumps(sizes, indent=1) + "\n")


def compile_serving(name: str, work: pathlib.Path) -> None:
    """Each of `PROGRAMS` compiled in a process of its own (`compile_program`)."""
    for program in PROGRAMS:
        module = "pallas_flash_bench.models.maxtext_serving"
        subprocess.run([sys.executable, "-m", module, "compile", "--config", name,
                        "--program", program, "--work", str(work)], check=True)  # fmt: skip


KEPT = 24
"""How many of an estimate's long lists (ops without a listing, collectives) the analysis keeps:
an unrolled 32-layer program has thousands; the count of each is kept too."""


def _trimmed(found: dict) -> dict:
    """``found`` with its long lists cut to `KEPT` entries (collectives: the costliest) and
    each list's full length as ``KEY_count``."""
    out = dict(found)
    for key in ("ops_without_listing", "ops_with_unknown_inner_loops", "collectives"):
        items = found.get(key, [])
        if key == "collectives":
            items = sorted(items, key=lambda c: -c["seconds"])
        out[key], out[f"{key}_count"] = items[:KEPT], len(items)
    return out


def estimate_serving(ref: ServingReference, work: pathlib.Path) -> dict:
    """The analysis of the compiled programs (`compile_program`'s files): each one's
    whole-program estimate on one chip of the slice and memory, and the run's output tokens/s
    at each end of the estimate (`tokens_per_second`) against the published figure."""
    from pallas_flash_estimate.cost import llo
    from pallas_flash_estimate.program import whole_program
    from pallas_flash_estimate.targets import TARGETS

    target = TARGETS[ref.topology]
    programs = {}
    for program in PROGRAMS:
        # Prefill's attention is splash (causal: blocks above the diagonal skipped); decode's
        # is XLA's dot product over the whole cache, no Pallas kernel to charge.
        occupancy = kernel_cost.FullGrid(causal=program == "prefill")
        found = whole_program.program_estimate(
            (work / program / "program.hlo.txt").read_text(),
            llo.load_dump(work / program / "dump", target.mxu_rows_per_cycle),
            lambda _, o=occupancy: o, target,
            target.chips,
        )  # fmt: skip
        memory = json.loads((work / program / "memory.json").read_text())
        programs[program] = {"estimate": _trimmed(found), "memory_bytes": memory}
    batch = ref.batch_per_chip * target.chips
    seconds = {end: [programs[p]["estimate"][f"step_seconds_{end}"] for p in PROGRAMS]
               for end in whole_program.ENDS}  # fmt: skip
    rates = {end: tokens_per_second(batch, ref.generate_length, *seconds[end]) for end in seconds}
    return {
        "name": ref.name,
        "reference": dataclasses.asdict(ref),
        "programs": programs,
        "batch": batch,
        "tokens_per_second": rates,
        "measured_tokens_per_second": ref.published_tokens_per_second,
        "analysis": whole_program.ANALYSIS_VERSION,
        "versions": analysis_versions(),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_flash_bench.models.maxtext_serving")
    parser.add_argument("stage", choices=("compile", "estimate"))
    parser.add_argument("--config", choices=sorted(SERVING), default="llama2-7b")
    parser.add_argument("--program", choices=PROGRAMS, help="compile: this one, in-process")
    parser.add_argument("--work", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, help="estimate: the analysis's JSON file")
    args = parser.parse_args(argv)
    ref = SERVING[args.config]
    if args.stage == "compile":
        if args.program is None:
            compile_serving(args.config, args.work)
        else:
            compile_program(ref, args.program, args.work)
        return 0
    text = json.dumps(estimate_serving(ref, args.work), indent=1) + "\n"
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
