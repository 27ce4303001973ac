"""Compile a model workload's programs for its v5e slice and estimate them (in the worker).

A train workload is one program, the LLaMa package's train step; a serving workload three, as
a server runs them: its prefill step (``prefill_batch`` prompts into a cache of their own), the
insert of those prefilled sequences into the decode batch's cache (`insert`), and its decode
step with the next tokens sampled (greedy, JetStream's default), each cache donated; an engine
workload one, the serving engine's step at its token bucket (`backend_kernels.occupancy` says
what its kernels run), its sampler charged as `sampler_branches.ENGINE_SAMPLING` samples and
estimated under every way of `sampler_branches.SAMPLINGS` beside (``"sampling"``: the step's
seconds at each end, by way). Each is compiled and estimated as a whole program
(`compile_program`).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_flash_bench.kernels import backend_kernels
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_bench.models import sampler_branches
from pallas_flash_bench.models.model_workloads import ModelWorkload
from pallas_flash_estimate.aot.compiled import Compiled, compile_program
from pallas_flash_estimate.aot.devices import target_devices
from pallas_flash_estimate.cost.kernel_cost import Occupancy
from pallas_flash_estimate.program.whole_program import ENDS, compiled_estimate
from pallas_flash_estimate.read import hlo
from pallas_flash_estimate.targets import TARGETS, Target


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


def _occupancy(w: ModelWorkload, program: str) -> Callable[[str], Occupancy]:
    """What each Pallas kernel of ``program`` runs, by kernel name."""
    if w.step == "engine":
        return backend_kernels.occupancy(w.decode_backend, w.engine_mix(w.mesh[2]),
                                         w.engine_bucket, w.kv_dtype)  # fmt: skip
    kernels = _kernel_workload(w, program)
    return lambda _: kernels


def _programs(w: ModelWorkload, mesh) -> dict[str, tuple]:
    """``{program: (jitted step, abstract arguments)}`` of a workload."""
    from pallas_flash_llama import abstract, engine_step, generation
    from pallas_flash_llama.train import TrainConfig, make_train_step

    config = w.config
    if w.step == "engine":
        mix = w.engine_mix()
        slots, pages = len(mix.sequence_lengths), mix.seq_len // mix.page_size
        cache = abstract.paged_cache(config, slots, pages, mix.num_pages, mix.page_size, mesh,
                                     w.kv_dtype)  # fmt: skip
        step = engine_step.step_program(cache, config, w.decode_backend, mesh)
        batch = abstract.step_batch(slots, w.engine_bucket, pages, mesh)
        params = abstract.inference_params(config, mesh, w.weights)
        return {"step": (step, (params, cache, batch))}
    if w.step == "train":
        train_config = TrainConfig()
        step = make_train_step(config, train_config, backend=w.backend, mesh=mesh,
                               donate=w.donate)  # fmt: skip
        args = (abstract.train_state(config, train_config, mesh),
                abstract.batch(w.batch, w.seq_len, mesh))  # fmt: skip
        return {"train": (step, args)}
    params = abstract.inference_params(config, mesh, w.weights)
    max_len = w.prompt_len + w.generate_len
    cache = abstract.contiguous_cache(config, w.batch, max_len, mesh, w.kv_dtype, w.cache_split)
    prefill_batch = min(w.prefill_batch, w.batch)
    prefill_cache = abstract.contiguous_cache(config, prefill_batch, max_len, mesh, w.kv_dtype,
                                              w.cache_split)  # fmt: skip
    tokens, lengths = abstract.prompts(prefill_batch, w.prompt_len, mesh)
    new_tokens = jax.ShapeDtypeStruct((w.batch,), jnp.int32, sharding=lengths.sharding)
    decode = generation.jitted("decode", cache, config, w.decode_backend, mesh)

    def decode_and_sample(params, cache, tokens):
        logits, cache = decode(params, cache, tokens)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    slot = jax.ShapeDtypeStruct((), jnp.int32)
    return {
        "prefill": (generation.jitted("prefill", prefill_cache, config, w.backend, mesh),
                    (params, prefill_cache, tokens, lengths)),
        "insert": (jax.jit(insert, donate_argnames="cache"), (cache, prefill_cache, slot)),
        "decode": (jax.jit(decode_and_sample, donate_argnames="cache"),
                   (params, cache, new_tokens)),
    }  # fmt: skip


def insert(cache, prefix, slot: jax.Array):
    """``cache`` (a contiguous `pallas_flash_llama.kv_cache.KVCache`, donated) with the
    sequences of ``prefix`` (prefilled, as many positions) written over its rows from ``slot``
    on, as a server inserts prefilled requests into its decode batch."""

    def put(rows, new):
        return jax.lax.dynamic_update_slice_in_dim(rows, new, slot, axis=0)

    def layers(rows, new):
        return None if rows is None else tuple(map(put, rows, new))

    return dataclasses.replace(
        cache,
        k=layers(cache.k, prefix.k),
        v=layers(cache.v, prefix.v),
        k_scales=layers(cache.k_scales, prefix.k_scales),
        v_scales=layers(cache.v_scales, prefix.v_scales),
        lengths=put(cache.lengths, prefix.lengths),
    )


def analyse_model(w: ModelWorkload, dump_dir: pathlib.Path | None) -> dict:
    """Every program of ``w`` compiled and estimated: ``{"workload", "programs": [...]}``."""
    from pallas_flash_llama.sharding import make_mesh

    target = TARGETS[w.target]
    mesh = make_mesh(*w.mesh, devices=target_devices(target)[: w.chips])
    analysed = []
    for name, (step, args) in _programs(w, mesh).items():
        compiled = compile_program(name, step, args, target, dump_dir)
        if w.step == "engine":
            analysed.append(_engine_estimate(w, compiled, target))
        else:
            analysed.append(compiled_estimate(compiled, _occupancy(w, name), target, w.chips))
    return {"workload": w.to_json(), "programs": analysed}


def _engine_estimate(w: ModelWorkload, compiled: Compiled, target: Target) -> dict:
    """An engine step's estimate with its sampler charged as `sampler_branches` says."""
    occupancy = _occupancy(w, "step")
    if compiled.text is None:
        return compiled_estimate(compiled, occupancy, target, w.chips)
    comps = hlo.parse_computations(compiled.text)
    # the sensitivity sweep for the row's way only: the others give their step alone
    by_way = {
        way: compiled_estimate(compiled, occupancy, target, w.chips,
                               sampler_branches.branch_shares(comps, w.config.vocab, way),
                               sensitivity=way == sampler_branches.ENGINE_SAMPLING)
        for way in sampler_branches.SAMPLINGS
    }  # fmt: skip
    found = by_way[sampler_branches.ENGINE_SAMPLING]
    if "estimate" in found:
        found["sampling"] = {way: {end: r["estimate"][f"step_seconds_{end}"] for end in ENDS}
                             for way, r in by_way.items()}  # fmt: skip
    return found
