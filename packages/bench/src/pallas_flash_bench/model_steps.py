"""Compile a model workload's programs for its v5e slice and estimate them (in the worker).

A train workload is one program, the LLaMa package's train step; a serving workload two, its
prefill step (``prefill_batch`` prompts) and its decode step (one token per sequence, the cache
donated). Each is compiled ahead of time with the LLO dump on, then estimated as a whole
program (`whole_program`); a program the slice's HBM cannot hold is a result too: the
compiler's error says how much it needed.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import time

import jax
import jax.numpy as jnp

from pallas_flash_bench import aot, llo, whole_program
from pallas_flash_bench.model_workloads import ModelWorkload
from pallas_flash_bench.targets import TARGETS, Target
from pallas_flash_bench.workloads import Workload

_NEEDED_RE = re.compile(r"memory required for HLO temporaries \((?P<size>[\d.]+)(?P<unit>[KMGT])\)")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _kernel_workload(w: ModelWorkload, program: str) -> Workload:
    """The attention one chip's Pallas kernels run in ``program``: causal over the local
    sequences and heads for training and prefill. A decode over a cache split over kv heads:
    the chip's sequences at lengths spread evenly over those a run's decode steps attend to,
    ``prompt_len + 1`` to ``prompt_len + generate_len`` (the kernel reads whole blocks or
    pages, not positions: the batch of every length once is charged what the run's steps
    read on average); split along the sequence: every block charged (the first chips' shares
    are full from the first step)."""
    c = w.config
    data, fsdp, tensor = w.mesh
    heads = dict(q_heads=max(c.q_heads // tensor, 1), kv_heads=max(c.kv_heads // tensor, 1),
                 head_dim=c.head_dim)  # fmt: skip
    if program == "train":
        return Workload("forward", w.seq_len, True, batch=w.batch // (data * fsdp), **heads)
    if program == "prefill":
        return Workload("forward", w.prompt_len, True, batch=min(w.prefill_batch, w.batch),
                        **heads)  # fmt: skip
    max_len = w.prompt_len + w.generate_len
    if w.cache_split == "sequence":
        return Workload("decode", max_len, batch=w.batch, **heads)
    run = (w.prompt_len + 1, max_len)
    return Workload("decode", max_len, batch=w.batch // (data * fsdp), lengths=run,
                    even_lengths=True, **heads)  # fmt: skip


def _programs(w: ModelWorkload, mesh) -> dict[str, tuple]:
    """``{program: (jitted step, abstract arguments)}`` of a workload."""
    from pallas_flash_llama import abstract, generation
    from pallas_flash_llama.train import TrainConfig, make_train_step

    config = w.config
    if w.step == "train":
        train_config = TrainConfig()
        step = make_train_step(config, train_config, backend=w.backend, mesh=mesh,
                               donate=w.donate)  # fmt: skip
        args = (abstract.train_state(config, train_config, mesh),
                abstract.batch(w.batch, w.seq_len, mesh))  # fmt: skip
        return {"train": (step, args)}
    params = abstract.inference_params(config, mesh)
    max_len = w.prompt_len + w.generate_len
    cache = abstract.contiguous_cache(config, w.batch, max_len, mesh, w.kv_dtype, w.cache_split)
    prefill_batch = min(w.prefill_batch, w.batch)
    prefill_cache = abstract.contiguous_cache(config, prefill_batch, max_len, mesh, w.kv_dtype,
                                              w.cache_split)  # fmt: skip
    tokens, lengths = abstract.prompts(prefill_batch, w.prompt_len, mesh)
    new_tokens = jax.ShapeDtypeStruct((w.batch,), jnp.int32, sharding=lengths.sharding)
    return {
        "prefill": (generation.jitted("prefill", prefill_cache, config, w.backend, mesh),
                    (params, prefill_cache, tokens, lengths)),
        "decode": (generation.jitted("decode", cache, config, w.decode_backend, mesh),
                   (params, cache, new_tokens)),
    }  # fmt: skip


def needed_bytes(error: str) -> int | None:
    """The HBM a program needed, from the compiler's out-of-memory message (None if absent)."""
    m = _NEEDED_RE.search(error)
    return None if m is None else int(float(m["size"]) * _UNITS[m["unit"]])


def _analyse_program(w, name, step, args, target: Target, dump_dir: pathlib.Path | None):
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
    if dump_dir is None:
        out["notes"].append("no LLO dump was requested: no static schedule")
        return out
    schedules = llo.load_dump(dump_dir)
    out["estimate"] = whole_program.program_estimate(
        compiled.as_text(), schedules, lambda _: _kernel_workload(w, name), target, w.chips
    )
    return out


def analyse_model(w: ModelWorkload, dump_dir: pathlib.Path | None) -> dict:
    """Every program of ``w`` compiled and estimated: ``{"workload", "programs": [...]}``."""
    from pallas_flash_llama.sharding import make_mesh

    target = TARGETS[w.target]
    devices = aot.target_devices(target)
    mesh = make_mesh(*w.mesh, devices=devices[: w.chips])
    programs = [
        _analyse_program(w, name, step, args, target, dump_dir)
        for name, (step, args) in _programs(w, mesh).items()
    ]
    return {"workload": w.to_json(), "programs": programs}
