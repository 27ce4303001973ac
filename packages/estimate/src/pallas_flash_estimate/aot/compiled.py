"""One program (a user's function, a model step, a context-parallel attention step) compiled
ahead of time for a TPU target, in a worker process (`worker`), and what estimating it as a
whole reads.

`compile_program` compiles it with the LLO dump on and records its memory (the compiler's
analysis), its layout copies and its FLOPs, with the HLO and listings a whole-program
estimate reads (`program.whole_program.compiled_estimate`). A program the slice's HBM cannot
hold is a result too: the compiler's error says how much it needed.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence

import jax

from pallas_flash_estimate.aot.devices import cost_analysis, target_devices
from pallas_flash_estimate.cost import llo
from pallas_flash_estimate.read import hlo_ops
from pallas_flash_estimate.targets import Target

_NEEDED_RE = re.compile(r"memory required for HLO temporaries \((?P<size>[\d.]+)(?P<unit>[KMGT])\)")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A program `compile_program` compiled: ``result``, what the bench records of it
    (``{"program", "compiled", "error", "hbm", "estimate": None, "notes", "compile_seconds",
    "copies", "flops"}``; ``needed_bytes`` instead of the memory when it did not fit), and what
    estimating it reads: its optimised HLO ``text`` and the dump's listings by op name,
    ``schedules`` (None when it did not compile or no dump was asked for)."""

    result: dict
    text: str | None = None
    schedules: Mapping[str, llo.KernelSchedule] | None = None


def needed_bytes(error: str) -> int | None:
    """The HBM a program needed, from the compiler's out-of-memory message (None if absent)."""
    m = _NEEDED_RE.search(error)
    return None if m is None else int(float(m["size"]) * _UNITS[m["unit"]])


def compile_program(
    name: str,
    step: Callable,
    args: Sequence,
    target: Target,
    dump_dir: pathlib.Path | None,
) -> Compiled:
    """The jitted ``step`` on abstract ``args`` (shardings on the target's devices) compiled
    for ``target`` and recorded as ``name``; ``dump_dir``: where this process's libtpu writes
    its LLO dump (None: no dump, nothing to estimate). ``copies``: the entry computation's
    copies that change a layout (`hlo_ops.find_copy_trap`); ``flops``: the compiler's count
    (`cost_analysis`)."""
    if dump_dir is not None:
        shutil.rmtree(dump_dir, ignore_errors=True)
        dump_dir.mkdir(parents=True)
    start = time.perf_counter()
    out: dict = {"program": name, "compiled": False, "error": None, "hbm": None,
                 "estimate": None, "notes": []}  # fmt: skip
    try:
        with jax.default_device(target_devices(target)[0]):
            lowered = step.trace(*args).lower(lowering_platforms=("tpu",))
        compiled = lowered.compile()
    except Exception as exc:  # noqa: BLE001 - out of memory is a result, not a crash
        out["compile_seconds"] = time.perf_counter() - start
        text = " ".join(str(exc).split())
        out["error"] = text[:600]
        out["needed_bytes"] = needed_bytes(text)
        return Compiled(out)
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
    out["flops"] = cost_analysis(compiled).get("flops")
    if dump_dir is None:
        out["notes"].append("no LLO dump was requested: no static schedule")
        return Compiled(out)
    return Compiled(out, text, llo.load_dump(dump_dir, target.mxu_rows_per_cycle))
