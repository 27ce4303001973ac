"""Developer tasks: `nox` runs lint, tests, conformance and docs; `nox -s bench` the v5e report.

Tests and conformance run on two stacks (`STACKS`): the pinned one of constraints.txt
(Python 3.11), behind every published figure, and the newest one the registry serves
(Python 3.12, constraints-newest.txt). Every session installs the local packages through uv,
whose cache shares jax and its wheels between sessions instead of downloading them again.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import nox

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "conformance", "wheels", "estimate-alone", "docs"]

ROOT = pathlib.Path(__file__).parent
PACKAGES = ROOT / "packages"

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
"""Bytecode caches on: a run starts many Python processes (test workers, the bench's and the
estimator's compile workers, multi-process jobs), and uv installs packages without their
bytecode. With ``PYTHONDONTWRITEBYTECODE`` set (as some sandboxes do), each of those processes
compiles jax's sources again (``import jax`` 4.0 s instead of 1.3 s; the estimator's tests 26 s
instead of 10 s on 2 cores); without it, the first import in a session's environment writes
the caches (into .nox/ and the ignored __pycache__ folders) and every later process reads
them."""


def _python(version: str) -> str:
    """An interpreter of Python ``version``, asked for its own path: ``pythonX.Y`` on the PATH,
    else pyenv's (whose shim answers only where pyenv selects it); ``version`` when neither
    runs."""
    pyenv = pathlib.Path.home() / ".pyenv" / "versions"
    found = sorted(map(str, pyenv.glob(f"{version}*/bin/python{version}")))
    for candidate in filter(None, [shutil.which(f"python{version}"), *found]):
        asked = subprocess.run([candidate, "-c", "import sys; print(sys.executable)"],
                               capture_output=True, text=True, check=False)  # fmt: skip
        if asked.returncode == 0 and asked.stdout.strip():
            return asked.stdout.strip()
    return version


STACKS = {"pinned": ("3.11", "constraints.txt"), "newest": ("3.12", "constraints-newest.txt")}
"""Stack -> its Python and constraints file: the pinned stack and the newest one."""
ON_STACKS = nox.parametrize(
    "python,stack",
    [(_python(version), name) for name, (version, _) in STACKS.items()],
    ids=list(STACKS),
)
"""Runs a session once per stack (``tests(pinned)``, ``tests(newest)``)."""
CORE = str(PACKAGES / "core")
CONFORMANCE = str(PACKAGES / "conformance")
ESTIMATE = str(PACKAGES / "estimate")
BENCH = str(PACKAGES / "bench")
LLAMA = str(PACKAGES / "llama")
BACKENDS = {
    path.name.removeprefix("backend_"): str(path)
    for path in sorted(PACKAGES.glob("backend_*"))
    if (path / "pyproject.toml").exists()
}
"""Backend name -> package folder, for every backend package that exists."""

RACE_CHECKED = {
    "pallas": "test_gradients or test_features or 6144 or (test_long_gradients and 8192)",
    "splitkv": "test_decode or test_serving_decode or test_ragged_under_jit or test_ragged_packed",
}
"""Backends whose kernels run in Pallas's TPU interpreter off TPU -> the conformance tests
(``-k``) that run with its race detector on (and not again without it)."""

MULTI_DEVICE = ("splitkv", "pallas")
"""Backends that declare ``multi_device`` or ``context_parallel``: their conformance suite
runs with 4 host devices (set before jax initialises, in the pytest process's environment), so
the tests that take a mesh run on 4 devices (a 1-device mesh: the backends' unit tests)."""
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count=4"
DETECT_RACES_ENV_VAR = "PALLAS_FLASH_DETECT_RACES"  # pallas_flash.interpret's, not imported here
PARALLEL = ("--numprocesses=auto", "--maxprocesses=4", "--dist=worksteal")
"""pytest-xdist: one test process per core (at most 4; CI has 2). Interpret-mode kernels and
Mosaic compiles each keep one core busy, so two processes halve a 2-core machine's run; an
idle process takes queued tests from the other (a few tests take minutes)."""
PINNED_ONLY = {
    "packages/conformance/tests/test_toy_backends.py":
        "our own test machinery: the suite failing broken toy backends",
    "packages/bench/tests/test_cli.py":
        "whole `pallas-flash bench` runs writing their report, whose figures are the pinned "
        "stack's (`nox -s bench-newest` runs the newest stack's)",
    "packages/llama/tests/test_aot.py":
        "whole Llama steps compiled for v5e slices: XLA's program around the kernels, which "
        "the backends' AOT tests compile for v5e on this stack too",
    "packages/llama/tests/test_multiprocess.py":
        "the CLI's jobs over 2 and 4 processes, minutes of process start-up; jax.distributed "
        "across processes is the conformance suite's `test_across_processes` on this stack",
}  # fmt: skip
"""Test files the newest stack does not repeat -> why. Every other test of kernels, models,
compiles and APIs runs on both stacks (on the newest, a share of its cases:
`NEWEST_EVERY_NTH_CASE`) but the heaviest compiles (`HEAVY_COMPILES`). The race detector runs
on the pinned stack only too: races are a property of the kernels' DMAs and semaphores, the
same code on either stack."""


NEWEST_EVERY_NTH_CASE = 6
"""The newest stack runs the first and every sixth case of each parametrized test
(``--every-nth-case``, `pallas_flash_conformance.case_share`): every test's code runs on the
newest releases, for CI's time, while the pinned stack runs every case. The cases are the
same on every run of a commit. (A sixth rather than a third: the conformance suites are where
the share saves time, their cases being many and alike; the unit tests' time is mostly in
unparametrized tests and first cases, which run whatever the share.)"""


HEAVY_COMPILES = (
    "packages/backend_pallas/tests/test_aot.py::test_the_vmem_estimate_is_enough[defaults-d256-bf16]",
    "packages/backend_pallas/tests/test_aot.py::test_the_vmem_estimate_is_enough[defaults-d256-f32]",
    "packages/backend_pallas/tests/test_aot.py::test_the_vmem_estimate_is_enough[4096x4096-in-16-sub-blocks]",
    "packages/backend_pallas/tests/test_aot.py::test_context_parallel_training_over_a_slice",
    "packages/backend_pallas/tests/test_aot.py::test_compiles_for_each_generation[v5p-d256-f32]",
    "packages/backend_pallas/tests/test_aot.py::test_480k_tokens_train_on_one_v5e_chip",
    "packages/backend_pallas/tests/test_aot.py::test_mla_head_dims_compile_to_their_kernels",
    "packages/backend_pallas/tests/test_aot.py::test_long_gqa_gradients_fit_in_chunks",
    "packages/bench/tests/test_workloads.py::test_a_paged_slice_spreads_each_sequence_round_its_chips",
)  # fmt: skip
"""The heaviest compiles for a TPU (up to a minute each on 2 cores), which the newest stack
does not repeat, for CI's time: the largest shapes and slices behind the VMEM estimate, the
memory of long and context-parallel training and MLA head dims. The newest stack still
compiles the attention, decode, paged and ragged kernels for v5e (and v4, v6e) at the other
AOT tests' shapes, and its quick bench (`nox -s bench-newest`) compiles the sweep's rows; what
only the pinned stack compiles is listed here (among them the split backward of very long
sequences and MLA's head dims)."""


def _install(session: nox.Session, *requirements: str, stack: str = "pinned") -> None:
    session.install("--constraint", str(ROOT / STACKS[stack][1]), *requirements)


def _compilation_cache(stack: str) -> dict[str, str]:
    """The environment that turns on jax's persistent compilation cache, one folder per stack
    (in .nox/), shared by that stack's tests and conformance sessions and all their processes.

    A program compiled once (a conformance case's reference, the XLA backend's attention, a
    tiny model's step) is read back by every later test of the stack that compiles the same
    program, not compiled again: jax keys an entry by the program, its compile options and
    the jax, XLA and flag versions, so a hit is the very executable. Programs with host
    callbacks (kernels in Pallas's TPU interpreter) are not cached, compiles for a TPU on this
    host are never read back, and the bench's compile workers turn the cache off (they read
    the dumps a compile writes). No size limit: a limit makes every write lock the folder and
    list it whole. An entry another process is still writing fails to decompress and is
    compiled again (jax warns).
    """
    return {
        "JAX_COMPILATION_CACHE_DIR": str(ROOT / ".nox" / f"jax-compilation-cache-{stack}"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole repository."""
    _install(session, "ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


def _sampled_cases(session: nox.Session) -> list[str]:
    """The newest stack's share of the cases (`NEWEST_EVERY_NTH_CASE`); every case when the
    session was given arguments (a developer's own selection)."""
    return [] if session.posargs else [f"--every-nth-case={NEWEST_EVERY_NTH_CASE}"]


@nox.session
@ON_STACKS
def tests(session: nox.Session, stack: str) -> None:
    """Each package's own unit tests, with every package installed, on one stack.

    The llama package's tests run in a pytest process of their own: they start jax with 4
    host CPU devices (its conftest sets the flag), which the other packages' tests do not
    expect.
    """
    _install(
        session,
        "pytest-xdist",
        CORE,
        CONFORMANCE,
        ESTIMATE,
        BENCH,
        f"{LLAMA}[flax,serve]",
        "openai",
        "httpx",
        *BACKENDS.values(),
        stack=stack,
    )
    test_dirs = [
        str(path) for path in sorted(PACKAGES.glob("*/tests")) if path.parent.name != "llama"
    ]
    # AOT tests load libtpu in this process while the bench tests start compile workers that
    # load it too: let libtpu's lock file admit more than one process.
    # --durations: the CI log names the slowest tests, what to trim when the run grows.
    once = []
    if stack != "pinned":
        once += [f"--ignore={ROOT / path}" for path in PINNED_ONLY]
        once += [f"--deselect={test}" for test in HEAVY_COMPILES]
        once += _sampled_cases(session)
    env = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", **_compilation_cache(stack)}
    session.run("pytest", *PARALLEL, "--durations=15", *test_dirs, *once, *session.posargs, env=env)
    llama_tests = str(PACKAGES / "llama" / "tests")
    session.run("pytest", *PARALLEL, "--durations=10", llama_tests, *once, *session.posargs,
                env=env)  # fmt: skip


@nox.session
@ON_STACKS
@nox.parametrize("backend", list(BACKENDS), ids=list(BACKENDS))
def conformance(session: nox.Session, backend: str, stack: str) -> None:
    """The conformance suite against one backend, installed alone with core, on one stack."""
    _install(session, "pytest-xdist", CORE, CONFORMANCE, BACKENDS[backend], stack=stack)
    session.chdir(session.create_tmp())  # import the installed packages, not the source tree
    suite = ("pytest", "--pyargs", "pallas_flash_conformance", "--backend", backend)
    env = _compilation_cache(stack)
    if backend in MULTI_DEVICE:
        env["XLA_FLAGS"] = HOST_DEVICES_FLAG
    raced = RACE_CHECKED.get(backend) if not session.posargs and stack == "pinned" else None
    sampled = _sampled_cases(session) if stack != "pinned" else []
    # Each test runs once: the race-checked ones with the detector on (numerics checked too).
    session.run(*suite, *PARALLEL, *(("-k", f"not ({raced})") if raced else ()), *sampled,
                *session.posargs, env=env)  # fmt: skip
    if raced:
        # A test whose kernels the detector reports racing fails (the suite's plugin).
        session.run(*suite, *PARALLEL, "-k", raced, env=env | {DETECT_RACES_ENV_VAR: "1"})


@nox.session(python=_python(STACKS["pinned"][0]))
def wheels(session: nox.Session) -> None:
    """Every package built as an sdist and a wheel from it (``uv build``), the wheels installed
    into this session's fresh environment (not editable, not from the source tree) and
    `scripts/smoke_wheels.py` run from a folder outside the repository: a file, entry point or
    dependency missing from a wheel fails here."""
    dist = pathlib.Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for project in sorted(PACKAGES.glob("*/pyproject.toml")):
        uv_build = (sys.executable, "-m", "uv", "build", "--quiet")  # the uv nox runs with
        session.run(*uv_build, str(project.parent), "--out-dir", str(dist), external=True)
    _install(session, *map(str, sorted(dist.glob("*.whl"))))
    with tempfile.TemporaryDirectory() as outside:
        session.chdir(outside)
        session.run("python", str(ROOT / "scripts" / "smoke_wheels.py"))


@nox.session(name="estimate-alone", python=_python(STACKS["pinned"][0]))
def estimate_alone(session: nox.Session) -> None:
    """The estimator as a JAX user gets it: its wheel alone installed with what it declares
    (jax[tpu]; none of our other packages) into a fresh environment, and the example of its
    docs page (a user's jitted function estimated for v5e) run from a folder outside the
    repository."""
    dist = pathlib.Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    uv_build = (sys.executable, "-m", "uv", "build", "--quiet", "--wheel")
    session.run(*uv_build, ESTIMATE, "--out-dir", str(dist), external=True)
    _install(session, *map(str, dist.glob("*.whl")))
    with tempfile.TemporaryDirectory() as outside:
        session.chdir(outside)
        example = (
            str(ROOT / "scripts" / "run_docs_example.py"),
            str(ROOT / "docs" / "api" / "estimate.md"),
        )
        session.run("python", *example, "--expect", "static estimate")


def _bench(session: nox.Session, stack: str, out: pathlib.Path) -> None:
    """`pallas-flash bench --quick` (``-- --full``: the default sweep) on one stack, into
    ``out``, with the references this stack's constraints pin: tokamax (the bench package's
    ``tokamax`` extra) and tpu-inference (its Ragged Paged Attention v3), the latter without
    its dependencies (vllm, torch and more, none of which its kernel needs)."""
    _install(session, CORE, ESTIMATE, f"{BENCH}[tokamax]", LLAMA, *BACKENDS.values(), stack=stack)
    _install(session, "--no-deps", "tpu-inference", stack=stack)
    args = list(session.posargs)
    if "--full" in args:
        args.remove("--full")
    else:
        args.insert(0, "--quick")
    session.run("pallas-flash", "bench", "--out", str(out), *args)


@nox.session(python=_python(STACKS["pinned"][0]))
def bench(session: nox.Session) -> None:
    """The main job: `pallas-flash bench --quick` for the default target, on the pinned stack
    (behind every published figure), into bench-results/.

    Extra arguments go to `pallas-flash bench` (e.g. `nox -s bench -- --target v5e-4`); with
    `-- --full` the default (not quick) sweep runs. tokamax and tpu-inference come in as
    references here only: the tests sessions do without them.
    """
    _bench(session, "pinned", ROOT / "bench-results")


@nox.session(name="bench-newest", python=_python(STACKS["newest"][0]))
def bench_newest(session: nox.Session) -> None:
    """The main job on the newest stack (its jax, libtpu, tokamax and tpu-inference), into
    bench-results-newest/: its verdicts stand beside the pinned stack's in the docs
    (`pallas-flash readme --newest`)."""
    _bench(session, "newest", ROOT / "bench-results-newest")


MAXTEXT_REQUIREMENTS = (
    "maxtext==0.2.4", "jax[tpu]", "absl-py", "pyyaml", "omegaconf", "chex", "einops",
    "jaxtyping", "pydantic", "aqtp", "qwix", "tensorboardx", "pathwaysutils", "jinja2",
    "tokamax", "grain", "huggingface-hub", "transformers", "drjax", "pillow", "tiktoken",
    "sentencepiece", "sympy", "ml-goodput-measurement", "pluggy", "tqdm",
)  # fmt: skip
"""What MaxText's AOT path imports (its own dependencies are many more: TensorFlow, torch and
cloud clients, none of which compiling a train step needs), installed without dependencies'
dependencies beyond these; jax, flax, optax and orbax at the pins of constraints.txt."""


def _maxtext_env(session: nox.Session) -> None:
    """maxtext without its dependencies, what its AOT path imports, and ours."""
    session.install("--no-deps", "maxtext==0.2.4", CORE, ESTIMATE, BENCH)
    _install(session, "flax", "optax", "orbax-checkpoint", *MAXTEXT_REQUIREMENTS[1:])


@nox.session(python=_python("3.12"))
def maxtext(session: nox.Session) -> None:
    """MaxText's own train steps (16B, Llama-2-7B; or the configs given after ``--``)
    compiled for v5e-256 by MaxText's AOT path and estimated by ours
    (`pallas_flash_bench.models.maxtext_steps`): the calibration point behind MaxText's
    published v5e MFU, and the reference programs of the model rows. Python 3.12, as maxtext
    needs; about 6 minutes and 6 GB of LLO dump each (in .nox/maxtext-work-CONFIG, removed
    once read). Writes bench-results/maxtext-CONFIG-v5e-256.json: copy them into the bench
    package's data/ and rerun `pallas-flash bench --calibrate`.
    """
    _maxtext_env(session)
    module = ("python", "-m", "pallas_flash_bench.models.maxtext_steps")
    (ROOT / "bench-results").mkdir(exist_ok=True)
    for config in session.posargs or ("16b", "llama2-7b"):
        work = ROOT / ".nox" / f"maxtext-work-{config}"
        out = ROOT / "bench-results" / f"maxtext-{config}-v5e-256.json"
        session.run(*module, "compile", "--config", config, "--work", str(work))
        session.run(*module, "estimate", "--config", config, "--work", str(work), "--out", str(out))
        shutil.rmtree(work / "dump")  # gigabytes of LLO dump, read


@nox.session(name="lm_eval", python=_python(STACKS["pinned"][0]))
def lm_eval(session: nox.Session) -> None:
    """lm-evaluation-harness's ``local-completions`` against ``pallas-flash-llama serve`` on
    the tiny model: one loglikelihood and one generation task from local data, each
    loglikelihood checked against the model's float64 log-softmax and each generation against
    the server's greedy text (packages/llama/tests/lm_eval_against_server.py). Not in the
    default run: lm-eval brings torch, installed first as its CPU build (which this project's
    machines keep in /opt/wheels)."""
    wheels = ["--find-links", "/opt/wheels"] if pathlib.Path("/opt/wheels").is_dir() else []
    _install(session, *wheels, "torch")
    _install(session, CORE, BACKENDS["xla"], f"{LLAMA}[serve]", "lm-eval[api]", "httpx")
    session.run("python", str(PACKAGES / "llama" / "tests" / "lm_eval_against_server.py"))


@nox.session(name="maxtext-serving", python=_python("3.12"))
def maxtext_serving(session: nox.Session) -> None:
    """MaxText's inference engine (prefill, insert, generate) compiled for v5e-8 at
    JetStream-MaxText's Llama-2-7B settings (tpu-recipes) and estimated by ours
    (`pallas_flash_bench.models.maxtext_serving`): the reference serving program. Writes
    bench-results/maxtext-serving-llama2-7b-v5e-8.json: copy it into the bench package's
    data/. The LLO dumps (in .nox/maxtext-serving-work) are removed once read.
    """
    _maxtext_env(session)
    work = ROOT / ".nox" / "maxtext-serving-work"
    module = ("python", "-m", "pallas_flash_bench.models.maxtext_serving")
    args = ("--config", "llama2-7b", "--work", str(work))
    session.run(*module, "compile", *args)
    out = ROOT / "bench-results" / "maxtext-serving-llama2-7b-v5e-8.json"
    out.parent.mkdir(exist_ok=True)
    session.run(*module, "estimate", *args, "--out", str(out))
    for dump in work.glob("*/dump"):
        shutil.rmtree(dump)  # the LLO dumps, read


@nox.session
def docs(session: nox.Session) -> None:
    """Builds the mkdocs-material site with --strict into site/."""
    _install(session, "mkdocs-material", "mkdocstrings-python")
    session.run(
        "mkdocs",
        "build",
        "--strict",
        "--site-dir",
        str(ROOT / "site"),
        env={"NO_MKDOCS_2_WARNING": "1"},
    )
