"""Smoke test of Pallas-Flash's built wheels, as a user who installed them would see them.

CI builds every package's wheel (``uv build packages/X``: an sdist, then the wheel from it),
installs all of them, not editable, into a fresh virtual environment, and runs this script
with that environment's Python from a working directory outside the repository::

    /tmp/wheelvenv/bin/python /path/to/repo/scripts/smoke_wheels.py

It checks what only an installed wheel can get wrong: that every distribution is there, from
a wheel, at the one version of the repository's ``VERSION`` file, with its dependencies; the
console scripts (``pallas-flash``, ``pallas-flash-llama``); the backends' entry points
(``pallas_flash.backends``) and their kernels on tiny inputs; the packages' data files;
the conformance suite's pytest plugin (``pytest11``). Each check prints one line, ``ok`` or
``FAIL`` with the reason; the script exits 1 if any failed, and the checks after a failure
still run, so one run names everything missing.

jax runs on the CPU (``JAX_PLATFORMS=cpu`` unless set), where the Pallas kernels run in
Pallas's TPU interpreter (`pallas_flash.interpret`). About a minute on 2 cores.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

DISTRIBUTIONS = {
    "pallas-flash-core": "pallas_flash",
    "pallas-flash-xla": "pallas_flash_xla",
    "pallas-flash-pallas": "pallas_flash_pallas",
    "pallas-flash-splitkv": "pallas_flash_splitkv",
    "pallas-flash-conformance": "pallas_flash_conformance",
    "pallas-flash-estimate": "pallas_flash_estimate",
    "pallas-flash-bench": "pallas_flash_bench",
    "pallas-flash-llama": "pallas_flash_llama",
}
"""Every distribution of the repository -> the package it installs."""

BACKENDS = {
    "xla": "pallas-flash-xla",
    "pallas": "pallas-flash-pallas",
    "splitkv": "pallas-flash-splitkv",
}
"""The backends the wheels must register (``pallas_flash.backends``) -> their distribution."""
ATTENTION_BACKENDS = ("pallas",)
"""Backends whose ``pf.attention`` is compared to the ``xla`` backend's."""
DECODE_BACKENDS = ("splitkv",)
"""Backends whose ``pf.decode`` is compared to the ``xla`` backend's."""

CONSOLE_SCRIPTS = {"pallas-flash": "pallas-flash-bench", "pallas-flash-llama": "pallas-flash-llama"}
"""Console scripts -> the distribution that installs them."""

CONFORMANCE_SELECTION = "test_shapes or test_bad_input_raises"
"""The conformance tests (``-k``) run against ``xla``: about 60, some 15 seconds."""

VERSION_FILE = Path(__file__).resolve().parent.parent / "VERSION"
"""The repository's version file, when this script runs from a checkout."""

SUBPROCESS_TIMEOUT_S = 300


class SmokeError(Exception):
    """A check failed; the message says what is missing or wrong."""


def _environment() -> dict[str, str]:
    """The environment of the subprocesses: this interpreter's scripts first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), env.get("PATH", "")])
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)  # the conformance plugin must autoload
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _run(command: list[str], cwd: Path) -> str:
    """Runs ``command`` in ``cwd`` and returns its output (stdout and stderr).

    Raises:
      SmokeError: it exited non-zero or ran past `SUBPROCESS_TIMEOUT_S`; the message holds
        the end of its output.
    """
    try:
        done = subprocess.run(
            command,
            cwd=cwd,
            env=_environment(),
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        raise SmokeError(f"`{' '.join(command)}` ran past {SUBPROCESS_TIMEOUT_S} s") from error
    output = done.stdout + done.stderr
    if done.returncode != 0:
        tail = "\n".join("    " + line for line in output.strip().splitlines()[-20:])
        raise SmokeError(f"`{' '.join(command)}` exited {done.returncode}:\n{tail}")
    return output


def _console_script(name: str) -> str:
    """The path of console script ``name`` in this environment's scripts folder.

    Raises:
      SmokeError: it is not there.
    """
    scripts = sysconfig.get_path("scripts")
    found = shutil.which(name, path=scripts)
    if found is None:
        raise SmokeError(
            f"console script {name!r} is not in {scripts} "
            f"(installed by the {CONSOLE_SCRIPTS[name]} wheel's [project.scripts])"
        )
    return found


def check_distributions() -> str:
    """Every distribution is installed from a wheel (not editable, not the source tree), all
    at one version, the repository's ``VERSION`` where this script runs from a checkout."""
    versions: dict[str, str] = {}
    missing = []
    purelib = Path(sysconfig.get_path("purelib")).resolve()
    for dist_name, package in DISTRIBUTIONS.items():
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist_name)
            continue
        versions[dist_name] = dist.version
        direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
        if direct_url.get("dir_info", {}).get("editable"):
            raise SmokeError(f"{dist_name} is an editable install ({direct_url.get('url')})")
        module = importlib.import_module(package)
        where = Path(module.__file__ or "").resolve()
        if not where.is_relative_to(purelib):
            raise SmokeError(f"{package} is imported from {where}, not from {purelib}")
    if missing:
        raise SmokeError(f"not installed: {', '.join(missing)}")
    if len(set(versions.values())) != 1:
        raise SmokeError(f"the distributions' versions differ: {versions}")
    version = next(iter(versions.values()))
    if VERSION_FILE.is_file():
        expected = VERSION_FILE.read_text().strip()
        if version != expected:
            raise SmokeError(f"installed version {version}, but {VERSION_FILE} says {expected}")
    return f"{len(versions)} distributions from wheels, version {version}"


def check_dependencies() -> str:
    """Every requirement of every distribution (without extras) is installed at a version its
    specifier admits, as ``pip check`` would say."""
    from packaging.requirements import Requirement

    problems = []
    count = 0
    for dist_name in DISTRIBUTIONS:
        try:
            requires = importlib.metadata.requires(dist_name) or []
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{dist_name} is not installed")
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            count += 1
            try:
                installed = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                problems.append(f"{dist_name} requires {requirement}, not installed")
                continue
            if not requirement.specifier.contains(installed, prereleases=True):
                problems.append(f"{dist_name} requires {requirement}, {installed} is installed")
    if problems:
        raise SmokeError("; ".join(problems))
    return f"{count} requirements satisfied"


def check_console_script(name: str) -> str:
    """``NAME --help`` runs from this environment's scripts folder and prints its usage."""
    path = _console_script(name)
    with tempfile.TemporaryDirectory() as work:
        output = _run([path, "--help"], Path(work))
    if f"usage: {name}" not in output:
        raise SmokeError(f"`{name} --help` printed no usage line:\n{output[:500]}")
    return f"{path} --help"


def check_backends() -> str:
    """``pf.list_backends()`` finds exactly the first-party backends, each from its wheel."""
    import pallas_flash as pf

    found = {info.name: info.distribution for info in pf.list_backends()}
    missing = sorted(set(BACKENDS) - set(found))
    if missing:
        raise SmokeError(
            f"backend(s) {', '.join(missing)} not registered (from "
            f"{', '.join(BACKENDS[name] for name in missing)}); registered: {sorted(found)}"
        )
    extra = sorted(set(found) - set(BACKENDS))
    if extra:
        raise SmokeError(f"unexpected backend(s) registered: {extra}")
    wrong = {name: dist for name, dist in found.items() if dist != BACKENDS[name]}
    if wrong:
        raise SmokeError(f"backend(s) provided by the wrong distribution: {wrong}")
    return ", ".join(f"{name} ({dist})" for name, dist in sorted(found.items()))


def _reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal attention in float64 NumPy, ``[batch, heads, seq, head_dim]``."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    scores = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    seq = q.shape[-2]
    scores = np.where(np.tril(np.ones((seq, seq), dtype=bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


def _max_difference(a: object, b: object) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, np.float64))))


def check_attention(backend: str) -> str:
    """``pf.attention`` on a tiny causal float32 call, against the ``xla`` backend's output
    (itself checked against a float64 NumPy reference)."""
    import pallas_flash as pf
    from pallas_flash import interpret

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 128, 64), dtype=np.float32) for _ in range(3))
    expected = pf.attention(q, k, v, backend="xla", causal=True)
    to_reference = _max_difference(expected, _reference_attention(q, k, v))
    if not to_reference < 1e-4:
        raise SmokeError(f"xla differs from the NumPy reference by {to_reference:.2e}")
    out = pf.attention(q, k, v, backend=backend, causal=True)
    if out.shape != expected.shape or out.dtype != expected.dtype:
        raise SmokeError(f"{backend} returned {out.shape} {out.dtype}, xla {expected.shape}")
    difference = _max_difference(out, expected)
    if not difference < 1e-4:
        raise SmokeError(f"{backend} differs from xla by {difference:.2e}")
    mode = "interpreter" if interpret.interpret_params() is not None else "Mosaic"
    return f"[1, 2, 128, 64] causal, max |{backend} - xla| = {difference:.1e} ({mode})"


def check_decode(backend: str) -> str:
    """``pf.decode`` of one token per sequence against a tiny ragged GQA cache, against the
    ``xla`` backend's output."""
    import pallas_flash as pf

    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 64), dtype=np.float32)
    k_cache, v_cache = (rng.standard_normal((2, 2, 256, 64), dtype=np.float32) for _ in range(2))
    lengths = np.array([100, 256], dtype=np.int32)
    expected = pf.decode(q, k_cache, v_cache, lengths, backend="xla")
    out = pf.decode(q, k_cache, v_cache, lengths, backend=backend)
    difference = _max_difference(out, expected)
    if not difference < 1e-4:
        raise SmokeError(f"{backend} decode differs from xla by {difference:.2e}")
    return f"q [2, 4, 64], cache [2, 2, 256, 64], max |{backend} - xla| = {difference:.1e}"


def check_llama() -> str:
    """``pallas-flash-llama init-tiny`` writes a model that ``generate`` runs on."""
    path = _console_script("pallas-flash-llama")
    with tempfile.TemporaryDirectory() as work:
        _run([path, "init-tiny", "tiny"], Path(work))
        generate = [path, "--compilation-cache", "off", "generate", "--model", "tiny"]
        _run([*generate, "--prompt", "hi", "--max-new-tokens", "2", "--backend", "xla"], Path(work))
    return "init-tiny, then generate 2 tokens (xla)"


def check_package_data() -> str:
    """The packages' data files (the estimator's v5e calibration, the bench's committed
    MaxText analyses) load through the loaders that use them."""
    from pallas_flash_bench.models import maxtext_serving, maxtext_steps
    from pallas_flash_estimate import calibration

    loaded = calibration.load("v5e")
    if loaded is None:
        raise SmokeError(f"package data missing: {calibration.committed_path('v5e')}")
    calibration.describe(loaded)
    files = [calibration.committed_path("v5e").name]
    for module, names in (
        (maxtext_steps, maxtext_steps.STEPS),
        (maxtext_serving, maxtext_serving.SERVING),
    ):
        for name in names:
            if module.committed(name) is None:
                raise SmokeError(
                    f"package data missing: pallas_flash_bench/data/{module.data_file(name)}"
                )
            files.append(module.data_file(name))
    return ", ".join(files)


def check_conformance() -> str:
    """The conformance suite runs as ``pytest --pyargs pallas_flash_conformance --backend
    xla``: its plugin (``pytest11``) is registered and adds ``--backend``."""
    plugins = {entry.name for entry in importlib.metadata.entry_points(group="pytest11")}
    if "pallas_flash_conformance" not in plugins:
        raise SmokeError(f"no pytest11 entry point pallas_flash_conformance; found {plugins}")
    with tempfile.TemporaryDirectory() as work:
        ini = Path(work) / "pytest.ini"
        ini.write_text("[pytest]\n")  # no configuration file of the folders above applies
        pytest = [sys.executable, "-m", "pytest", "-c", str(ini), "-p", "no:cacheprovider"]
        suite = ["--pyargs", "pallas_flash_conformance", "--backend", "xla"]
        output = _run([*pytest, *suite, "-q", "-x", "-k", CONFORMANCE_SELECTION], Path(work))
    summary = [line for line in output.splitlines() if " passed" in line]
    if not summary:
        raise SmokeError(f"pytest reported no passed test:\n{output[-1000:]}")
    return f"xla, -k {CONFORMANCE_SELECTION!r}: {summary[-1].strip()}"


def main() -> int:
    """Runs every check, printing one line each; 1 if any failed, else 0."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    checks: list[tuple[str, Callable[[], str]]] = [
        ("distributions", check_distributions),
        ("dependencies", check_dependencies),
        *(
            (f"{name} --help", lambda name=name: check_console_script(name))
            for name in CONSOLE_SCRIPTS
        ),
        ("backends", check_backends),
        *((f"attention {b}", lambda b=b: check_attention(b)) for b in ATTENTION_BACKENDS),
        *((f"decode {b}", lambda b=b: check_decode(b)) for b in DECODE_BACKENDS),
        ("llama", check_llama),
        ("package data", check_package_data),
        ("conformance plugin", check_conformance),
    ]
    failed = []
    start = time.perf_counter()
    for name, check in checks:
        began = time.perf_counter()
        try:
            detail = check()
        except Exception as error:  # noqa: BLE001 (any failure is reported, then the next check runs)
            failed.append(name)
            message = (
                str(error) if isinstance(error, SmokeError) else f"{type(error).__name__}: {error}"
            )
            print(f"FAIL {name}: {message}", flush=True)
        else:
            print(f"ok   {name}: {detail} ({time.perf_counter() - began:.1f} s)", flush=True)
    seconds = time.perf_counter() - start
    if failed:
        names = ", ".join(failed)
        print(f"smoke test FAILED ({len(failed)} of {len(checks)}: {names}) in {seconds:.0f} s")
        return 1
    print(f"smoke test passed: {len(checks)} checks in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
