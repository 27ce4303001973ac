"""Generation: prefill a batch of prompts of different lengths, then decode token by token.

Prompts are right-padded to a common length and prefilled in one call through
``pf.attention`` (causal, so padding after a prompt cannot affect it); every layer's K/V is
written into the preallocated cache (`kv_cache`), and each sequence's length is its own
prompt's. A decode step embeds one token per sequence at position ``lengths[b]``, writes its
K/V there (overwriting padding) and attends through ``pf.decode``. Both steps are jitted with
the cache donated, so no step copies it. Layers run as a Python loop over per-layer weights
(`inference_params`), each reading its own cache buffer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import pallas_flash as pf
from pallas_flash_llama import sharding
from pallas_flash_llama.attention import cached_attention, self_attention
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.kv_cache import KVCache, init_cache
from pallas_flash_llama.layers import decoder_layer
from pallas_flash_llama.model import Params, compute_params, embed, unembed
from pallas_flash_llama.sampling import Sampling, sample

CACHE_ALIGN = 128
"""Cache lengths are rounded up to a multiple of this (times the mesh's devices)."""
PROMPT_BUCKET = 16
"""Prompts are padded to a power of two of at least this, so few lengths compile."""
PAD_ID = 0
GREEDY = Sampling()


def inference_params(params: Params, config: LlamaConfig) -> Params:
    """``params`` in the compute dtype with ``layers`` a list of per-layer dicts."""
    p = compute_params(params, config)
    layers = p["layers"]
    p["layers"] = [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(config.layers)]
    return p


def prefill(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    lengths: jax.Array,
    config: LlamaConfig,
    backend: str | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, KVCache]:
    """Runs the prompts and fills the cache (jitted by `jitted`, the cache donated).

    Args:
      params: `inference_params`.
      cache: an empty cache (donated).
      tokens: ``[batch, prompt_len]`` int32 prompts, right-padded.
      lengths: ``[batch]`` int32 prompt lengths (``1 <= lengths[b] <= prompt_len``).

    Returns:
      Float32 logits ``[batch, vocab]`` at each prompt's last token, and the cache holding
      ``lengths`` tokens per sequence.
    """
    step = jitted("prefill", cache, config, backend, mesh)
    return step(params, cache, tokens, lengths)


def _prefill(params, cache, tokens, lengths, config, backend, mesh):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x = sharding.constrain(embed(params, tokens, config), ("batch", "seq", "act_embed"), mesh)

    def attend(q, k, v):
        return self_attention(q, k, v, None, backend=backend, mesh=mesh), (k, v)

    ks, vs = [], []
    for i, layer in enumerate(params["layers"]):
        x, (k, v) = decoder_layer(x, layer, positions, attend, config, mesh)
        ks.append(jax.lax.dynamic_update_slice(cache.k[i], k.astype(cache.k[i].dtype), (0,) * 4))
        vs.append(jax.lax.dynamic_update_slice(cache.v[i], v.astype(cache.v[i].dtype), (0,) * 4))
    last = x[jnp.arange(x.shape[0]), lengths - 1]
    return unembed(params, last, config), KVCache(tuple(ks), tuple(vs), lengths)


def decode_step(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    config: LlamaConfig,
    backend: str | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, KVCache]:
    """Feeds one token per sequence at position ``cache.lengths[b]`` (jitted by `jitted`, the
    cache donated).

    Args:
      params: `inference_params`.
      cache: the cache (donated); every sequence must have room for one more token.
      tokens: ``[batch]`` int32.

    Returns:
      Float32 logits ``[batch, vocab]`` for the token after it, and the cache one longer.
    """
    return jitted("decode", cache, config, backend, mesh)(params, cache, tokens)


def _decode_step(params, cache, tokens, config, backend, mesh):
    positions = cache.lengths[:, None]
    x = embed(params, tokens[:, None], config)
    ks, vs = [], []
    for i, layer in enumerate(params["layers"]):
        attend = functools.partial(
            cached_attention,
            k_cache=cache.k[i],
            v_cache=cache.v[i],
            positions=cache.lengths,
            backend=backend,
            mesh=mesh,
        )
        x, (k, v) = decoder_layer(x, layer, positions, attend, config)
        ks.append(k)
        vs.append(v)
    logits = unembed(params, x[:, 0], config)
    return logits, KVCache(tuple(ks), tuple(vs), cache.lengths + 1)


_STEPS = {"prefill": _prefill, "decode": _decode_step}


def jitted(
    step: Literal["prefill", "decode"],
    cache: KVCache,
    config: LlamaConfig,
    backend: str | None = None,
    mesh: Mesh | None = None,
) -> jax.stages.Wrapped:
    """The ``"prefill"`` or ``"decode"`` step, jitted for ``cache``: the cache is donated and
    returned row-major in its own placement (`pf.cache_format`), so input and output alias and
    every step writes it in place. ``cache`` may hold ``jax.ShapeDtypeStruct``s, to compile
    ahead of time (``.trace(...)``); traced, it is left to the enclosing jit.
    """
    if step not in _STEPS:
        raise pf.InvalidInputError(f"step: expected one of {sorted(_STEPS)}, got {step!r}")
    return _jit(_STEPS[step], config, backend, mesh, pf.kept_format(cache.k[0]))


@functools.cache
def _jit(step, config, backend, mesh, kept) -> jax.stages.Wrapped:
    layers = (kept,) * config.layers
    return jax.jit(
        functools.partial(step, config=config, backend=backend, mesh=mesh),
        donate_argnames="cache",
        out_shardings=(None, KVCache(layers, layers, None)),
    )


def _padded_length(n: int) -> int:
    return max(PROMPT_BUCKET, 1 << (n - 1).bit_length())


def _check_prompts(prompts: Sequence[Sequence[int]], config: LlamaConfig) -> list[list[int]]:
    if not prompts:
        raise pf.InvalidInputError("prompts: expected at least one prompt, got none")
    checked = []
    for i, prompt in enumerate(prompts):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise pf.InvalidInputError(f"prompts[{i}]: expected at least one token, got none")
        if min(prompt) < 0 or max(prompt) >= config.vocab:
            raise pf.InvalidInputError(
                f"prompts[{i}]: expected token ids in [0, {config.vocab}), got "
                f"{[t for t in prompt if not 0 <= t < config.vocab][:5]}"
            )
        checked.append(prompt)
    return checked


def generate(
    params: Params,
    config: LlamaConfig,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    key: jax.Array | None = None,
    stop_tokens: Sequence[int] | None = None,
    max_len: int | None = None,
    backend: str | None = None,
    decode_backend: str | None = None,
    mesh: Mesh | None = None,
) -> Iterator[np.ndarray]:
    """Generates from a batch of prompts, yielding each step's tokens as they come.

    Args:
      params: the model's parameters (`model.init_params` or `weights.load_params`).
      prompts: token ids, one list per sequence, of any lengths.
      max_new_tokens: at most this many tokens per sequence.
      sampling: greedy by default; ``key`` (a ``jax.random.key``) is required otherwise.
      stop_tokens: a sequence ends after generating one of these; default ``config.eos_ids``.
      max_len: cache positions per sequence; default: the longest prompt plus
        ``max_new_tokens``, rounded up. Generation stops when a sequence fills it.
      backend: the ``pf.attention`` backend of the prefill; decode_backend: ``pf.decode``'s
        (``splitkv`` to split the cache over ``mesh``); default: the registry's choice.
      mesh: a ``(data, fsdp, tensor)`` mesh (`sharding.make_mesh`): weights sharded by
        `sharding.RULES`, the prompts' batch over data x fsdp, the cache's sequence axis over
        every device.

    Yields:
      ``[batch]`` int32 numpy arrays, one per step: each sequence's new token, or -1 once
      the sequence has stopped.

    Raises:
      pf.InvalidInputError: an empty or out-of-vocabulary prompt, a prompt that does not fit
        in ``max_len``, a missing key for sampling, or a mesh that does not divide the model
        or the batch.
    """
    prompts = _check_prompts(prompts, config)
    if max_new_tokens < 1:
        raise pf.InvalidInputError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    if sampling.temperature > 0 and key is None:
        raise pf.InvalidInputError("key: sampling with temperature > 0 needs a jax.random.key")
    key = jax.random.key(0) if key is None else key
    stop = np.asarray(config.eos_ids if stop_tokens is None else stop_tokens, np.int32)
    longest = max(len(p) for p in prompts)
    devices = 1 if mesh is None else mesh.size
    if mesh is not None:
        sharding.check_mesh(config, mesh, batch=len(prompts))
    if max_len is None:
        align = CACHE_ALIGN * devices
        max_len = math.ceil((longest + max_new_tokens) / align) * align
    if longest >= max_len:
        raise pf.InvalidInputError(
            f"prompts: the longest prompt has {longest} tokens, more than the cache's "
            f"max_len={max_len} leaves room for; pass a larger max_len"
        )
    budget = min(max_new_tokens, max_len - longest + 1)
    width = min(_padded_length(longest), max_len)
    tokens = np.full((len(prompts), width), PAD_ID, np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = prompt
    lengths = np.array([len(p) for p in prompts], np.int32)

    p = inference_params(params, config)
    cache = init_cache(config, len(prompts), max_len, mesh)
    logits, cache = prefill(p, cache, tokens, lengths, config, backend, mesh)
    done = np.zeros(len(prompts), bool)
    for step in range(budget):
        key, subkey = jax.random.split(key)
        next_tokens = sample(logits, subkey, sampling)
        host = np.asarray(next_tokens)
        yield np.where(done, -1, host).astype(np.int32)
        done |= np.isin(host, stop)
        if done.all() or step == budget - 1:
            return
        logits, cache = decode_step(p, cache, next_tokens, config, decode_backend, mesh)


def generate_all(*args, **kwargs) -> list[list[int]]:
    """`generate` run to the end: each sequence's new tokens (its stop token included)."""
    steps = list(generate(*args, **kwargs))
    if not steps:
        return []
    table = np.stack(steps, axis=1)
    return [[int(t) for t in row if t >= 0] for row in table]
