"""The worker process that compiles a program for a TPU target and estimates it.

libtpu reads its LLO dump flag once, when it starts, so a compile whose listings the
estimate reads runs in a process started with ``LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR``
(`dump_env`). `run` starts one for a `ProgramRef`, which the worker imports and compiles
(`analyse`); the worker prints its result as one line of JSON.

Run: ``python -m pallas_flash_estimate.aot.worker JOB.json DUMP_DIR``, where ``JOB.json``
is ``{"program": ProgramRef.to_json(), "target": name}``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Mapping

from pallas_flash_estimate.aot.program_ref import ProgramRef
from pallas_flash_estimate.cost import kernel_cost
from pallas_flash_estimate.program import whole_program
from pallas_flash_estimate.read import dump_files
from pallas_flash_estimate.targets import Target

RESULT_PREFIX = "PALLAS_FLASH_ESTIMATE_RESULT "
"""How a worker's line of results begins (the rest of the line is JSON); the bench's pool of
workers prints its lines the same way."""


def dump_env(
    dump_dir: pathlib.Path, env: Mapping[str, str] | None = None, generation: str | None = None
) -> dict[str, str]:
    """``env`` (default: this process's) for a worker whose libtpu writes its LLO dump to
    ``dump_dir`` (the passes the estimate reads: `read.dump_files.dump_flags`); several such
    workers may run at once (libtpu's lock file would refuse all but one). Pallas-Flash's
    kernels are emitted as Mosaic (``PALLAS_FLASH_INTERPRET=0``): on a host without a TPU
    they would otherwise trace as the interpreter's XLA ops, not the kernel the TPU runs;
    with ``generation``, they are sized for it (``PALLAS_FLASH_TPU``), not for v5e, the
    generation they assume off a TPU."""
    env = dict(os.environ if env is None else env)
    flags = f"{env.get('LIBTPU_INIT_ARGS', '')} {dump_files.dump_flags(dump_dir)}".strip()
    sized = {} if generation is None else {"PALLAS_FLASH_TPU": generation}
    return env | sized | {"LIBTPU_INIT_ARGS": flags, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
                          "PALLAS_FLASH_INTERPRET": "0"}  # fmt: skip


def run(ref: ProgramRef, target: Target) -> dict:
    """`analyse` of ``ref`` for ``target``, in a worker process that imports
    what this one can (its ``sys.path``); raises the worker's error if it printed no result."""
    with tempfile.TemporaryDirectory(prefix="pallas-flash-estimate-") as scratch:
        job, dump = pathlib.Path(scratch) / "job.json", pathlib.Path(scratch) / "dump"
        job.write_text(json.dumps({"program": ref.to_json(), "target": target.to_json()}))
        env = dump_env(dump, generation=target.generation)
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        args = [sys.executable, "-m", "pallas_flash_estimate.aot.worker", str(job), str(dump)]
        done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = "\n".join(done.stderr.strip().splitlines()[-20:])
    raise RuntimeError(f"{ref.label}: the worker exited with {done.returncode}:\n{tail}")


def analyse(ref: ProgramRef, target: Target, dump_dir: pathlib.Path) -> dict:
    """In a worker whose libtpu dumps to ``dump_dir`` (`dump_env`): ``ref`` compiled for one
    chip of ``target`` (`compiled.compile_program`) and estimated as a whole
    (`whole_program.compiled_estimate`), every Pallas kernel on its whole grid
    (`kernel_cost.FullGrid`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from pallas_flash_estimate.aot.compiled import compile_program
    from pallas_flash_estimate.aot.devices import target_devices

    device = SingleDeviceSharding(target_devices(target)[0])
    args = [jax.ShapeDtypeStruct(a.shape, jnp.dtype(a.dtype), sharding=device) for a in ref.args]

    kernels: set[str] = set()

    def occupancy(kernel: str) -> kernel_cost.FullGrid:
        kernels.add(kernel.split(".")[0])
        return kernel_cost.FullGrid(loop_trips=ref.trips_of(kernel))

    compiled = compile_program(ref.label, jax.jit(ref.resolve()), args, target, dump_dir)
    found = whole_program.compiled_estimate(compiled, occupancy, target, 1)
    unmatched = sorted({name for name, _ in ref.loop_trips} - kernels)
    if unmatched and compiled.schedules is not None:
        raise ValueError(
            f"{ref.label}: loop_trips names {unmatched}, but the program has no Pallas kernel "
            f"of that name (its kernels: {sorted(kernels) or 'none'}): its loops would be "
            "counted once"
        )
    return found


def main(argv: list[str]) -> None:
    import jax

    # the estimate reads the dumps a compile writes, so every program is compiled
    jax.config.update("jax_enable_compilation_cache", False)
    job = json.loads(pathlib.Path(argv[0]).read_text())
    ref = ProgramRef.from_json(job["program"])
    result = analyse(ref, Target.from_json(job["target"]), pathlib.Path(argv[1]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
