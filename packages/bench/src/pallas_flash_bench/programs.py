"""One program (a model step, a context-parallel attention step) compiled ahead of time for
a v5e slice and estimated as a whole, in the worker.

The program is compiled with the LLO dump on, its memory read from the compiler's analysis
and its step estimated from its HLO and listings (`whole_program`, by the caller's
``estimate``). A program the slice's HBM cannot hold is a result too: the compiler's error
says how much it needed.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence

import jax

from pallas_flash_bench import aot, whole_program
from pallas_flash_bench.targets import Target
from pallas_flash_bench.workloads import Workload
from pallas_flash_estimate.cost import llo
from pallas_flash_estimate.read import hlo_ops

_NEEDED_RE = re.compile(r"memory required for HLO temporaries \((?P<size>[\d.]+)(?P<unit>[KMGT])\)")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

Estimate = Callable[[str, Mapping[str, llo.KernelSchedule]], dict]
"""(optimised HLO text, the dump's listings by op name) -> the program's estimate."""


def one_shape_estimate(kernels: Workload, target: Target, chips: int) -> Estimate:
    """`whole_program.program_estimate` of a program whose Pallas kernels all run the
    attention ``kernels`` (one chip's shape) on one chip of ``chips``."""

    def estimate(text: str, schedules: Mapping[str, llo.KernelSchedule]) -> dict:
        return whole_program.program_estimate(text, schedules, lambda _: kernels, target, chips)

    return estimate


def needed_bytes(error: str) -> int | None:
    """The HBM a program needed, from the compiler's out-of-memory message (None if absent)."""
    m = _NEEDED_RE.search(error)
    return None if m is None else int(float(m["size"]) * _UNITS[m["unit"]])


def analyse_program(
    name: str,
    step: Callable,
    args: Sequence,
    target: Target,
    dump_dir: pathlib.Path | None,
    estimate: Estimate,
) -> dict:
    """``{"program": name, "compiled", "error", "hbm", "copies", "flops", "estimate",
    "notes", ...}`` of the jitted ``step`` on abstract ``args`` (shardings on the target's
    devices) compiled for ``target``; ``dump_dir``: where this process's libtpu writes its LLO
    dump (None: no dump, no estimate). ``copies``: the entry computation's copies that change
    a layout (`hlo_ops.find_copy_trap`); ``flops``: the compiler's count (`cost_analysis`)."""
    if dump_dir is not None:
        shutil.rmtree(dump_dir, ignore_errors=True)
        dump_dir.mkdir(parents=True)
    start = time.perf_counter()
    out: dict = {"program": name, "compiled": False, "error": None, "hbm": None,
                 "estimate": None, "notes": []}  # fmt: skip
    try:
        with jax.default_device(aot.target_devices(target)[0]):
            lowered = step.trace(*args).lower(lowering_platforms=("tpu",))
        compiled = lowered.compile()
    except Exception as exc:  # noqa: BLE001 - out of memory is a result, not a crash
        out["compile_seconds"] = time.perf_counter() - start
        text = " ".join(str(exc).split())
        out["error"] = text[:600]
        out["needed_bytes"] = needed_bytes(text)
        return out
    out["compile_seconds"] = time.perf_counter() - start
    out["compiled"] = True
    memory = compiled.memory_analysis()
    out["hbm"] = {
        "argument": memory.argument_size_in_bytes,
        "output": memory.output_size_in_bytes,
        "alias": memory.alias_size_in_bytes,
        "temp": memory.temp_size_in_bytes,
        # what the step holds at its peak: its inputs, the outputs not written in place of
        # an input, and its temporaries
        "peak": memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes,
    }
    text = compiled.as_text()
    out["copies"] = hlo_ops.relayout_copies(text)
    out["flops"] = aot.cost_analysis(compiled).get("flops")
    if dump_dir is None:
        out["notes"].append("no LLO dump was requested: no static schedule")
        return out
    out["estimate"] = estimate(text, llo.load_dump(dump_dir))
    return out
