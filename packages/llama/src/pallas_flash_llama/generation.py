"""Generation: prefill a batch of prompts of different lengths, then decode token by token.

Prompts are right-padded to a common length and prefilled in one call through
``pf.attention`` (causal, so padding after a prompt cannot affect it); every layer's K/V is
written into the preallocated cache (`kv_cache`: contiguous or paged, in the compute dtype or
int8), and each sequence's length is its own prompt's. A paged cache first gives each
sequence the pages its prompt takes, then its pages get the prompt's K/V whole. A decode step
embeds one token per sequence at position ``lengths[b]`` (a paged cache first allocates a
page to each sequence whose pages are full), writes its K/V there (overwriting padding;
quantized for an int8 cache) and attends through ``pf.decode``. Both steps are jitted with the
cache donated, so no step copies it. Layers run as a Python loop over per-layer weights
(`inference_params`), each reading its own cache buffer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import pallas_flash as pf
from pallas_flash.mesh_placement import to_host
from pallas_flash_llama import sharding
from pallas_flash_llama.attention import cached_attention, self_attention
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.kv_cache import (
    CacheSplit,
    KVCache,
    allocate_prompts,
    check_split,
    fill,
    init_cache,
    next_slots,
)
from pallas_flash_llama.layers import decoder_layer
from pallas_flash_llama.model import Params, compute_params, embed, unembed
from pallas_flash_llama.sampling import Sampling, sample

CACHE_ALIGN = 128
"""Cache lengths are rounded up to a multiple of this (times the mesh's devices when they
split the sequence)."""
PROMPT_BUCKET = 16
"""Prompts are padded to a power of two of at least this, so few lengths compile."""
PAGE_SIZE = 128
"""Positions per page of a paged cache by default."""
PAD_ID = 0
GREEDY = Sampling()
KV_CACHES = ("contiguous", "paged")
"""The cache layouts `generate` takes (``kv_cache=``)."""


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

    cache = allocate_prompts(cache, lengths)
    layers = []
    for i, layer in enumerate(params["layers"]):
        x, (k, v) = decoder_layer(x, layer, positions, attend, config, mesh)
        layers.append(fill(cache.layer(i), k, v, mesh if cache.split == "sequence" else None))
    last = x[jnp.arange(x.shape[0]), lengths - 1]
    return unembed(params, last, config), cache.with_layers(layers, lengths)


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
      cache: the cache (donated); every sequence must have room for one more token (a paged
        sequence without a free page to take keeps its length).
      tokens: ``[batch]`` int32.

    Returns:
      Float32 logits ``[batch, vocab]`` for the token after it, and the cache one longer.
    """
    return jitted("decode", cache, config, backend, mesh)(params, cache, tokens)


def _decode_step(params, cache, tokens, config, backend, mesh):
    positions = cache.lengths[:, None]
    cache, blocks, rows, active = next_slots(cache)
    lengths = cache.lengths + active.astype(jnp.int32)
    x = embed(params, tokens[:, None], config)
    layers = []
    for i, layer in enumerate(params["layers"]):
        attend = functools.partial(
            cached_attention,
            cache=cache.layer(i),
            blocks=blocks,
            positions=rows,
            lengths=lengths,
            backend=backend,
            mesh=mesh,
            split=cache.split,
        )
        x, layer_cache = decoder_layer(x, layer, positions, attend, config)
        layers.append(layer_cache)
    logits = unembed(params, x[:, 0], config)
    return logits, cache.with_layers(layers, lengths)


_STEPS = {"prefill": _prefill, "decode": _decode_step}


def jitted(
    step: Literal["prefill", "decode"],
    cache: KVCache,
    config: LlamaConfig,
    backend: str | None = None,
    mesh: Mesh | None = None,
) -> jax.stages.Wrapped:
    """The ``"prefill"`` or ``"decode"`` step, jitted for ``cache``: the cache is donated and
    its buffers (values and scales) returned row-major in their own placement
    (`pf.cache_format`), so input and output alias and every step writes them in place.
    ``cache`` may hold ``jax.ShapeDtypeStruct``s, to compile ahead of time (``.trace(...)``);
    traced, it is left to the enclosing jit.

    Raises:
      pf.InvalidInputError: an unknown step, or a cache whose split its layout does not take
        (`kv_cache.check_split`).
    """
    if step not in _STEPS:
        raise pf.InvalidInputError(f"step: expected one of {sorted(_STEPS)}, got {step!r}")
    return jit_step(_STEPS[step], cache, config, backend, mesh)


def jit_step(
    step: Callable[..., tuple[Any, KVCache]],
    cache: KVCache,
    config: LlamaConfig,
    backend: str | None = None,
    mesh: Mesh | None = None,
) -> jax.stages.Wrapped:
    """``step(params, cache, ..., config=, backend=, mesh=) -> (out, cache)`` (a module-level
    function) jitted as `jitted` jits its steps, once per step, cache layout and config: the
    cache donated and returned row-major in its own placement.

    Raises:
      pf.InvalidInputError: a cache whose split its layout does not take.
    """
    check_split(cache.split, cache.paged)
    scales = None if cache.k_scales is None else pf.kept_format(cache.k_scales[0])
    kept = pf.kept_format(cache.k[0])
    return _jit(step, config, backend, mesh, kept, scales, cache.split, cache.packed)


@functools.cache
def _jit(step, config, backend, mesh, kept, kept_scales, split, packed) -> jax.stages.Wrapped:
    layers = (kept,) * config.layers
    scales = None if kept_scales is None else (kept_scales,) * config.layers
    values = None if packed else layers
    return jax.jit(
        functools.partial(step, config=config, backend=backend, mesh=mesh),
        donate_argnames="cache",
        out_shardings=(None, KVCache(layers, values, None, scales, scales, None, split)),
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
    kv_cache: Literal["contiguous", "paged"] = "contiguous",
    kv_dtype: str | jnp.dtype | None = None,
    page_size: int = PAGE_SIZE,
    kv_split: CacheSplit | None = None,
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
        `sharding.RULES`, the prompts' batch over data x fsdp, the cache as ``kv_split``
        says.
      kv_cache: ``"contiguous"``, ``max_len`` positions per sequence, or ``"paged"``, a pool
        of pages per layer with a page table shared by the layers, pages allocated as the
        sequences grow (`kv_cache`; over a mesh, each sequence's pages go round the
        devices).
      kv_dtype: the cache's dtype: None for the compute dtype, or ``jnp.int8`` (or
        ``"int8"``): K and V quantized as they are written, a float32 scale per token and kv
        head.
      page_size: positions per page of a paged cache.
      kv_split: how a mesh splits the cache (`kv_cache.CacheSplit`): a contiguous one by
        default over batch and kv heads (``"heads"``, no exchange between devices), or along
        its sequence (``"sequence"``: each device holds a share of every sequence, for
        caches longer than one device holds; the ``splitkv`` decode merges the shares); a
        paged one's pages by default go round the devices (``"sequence"``), or its kv heads
        are split over ``tensor`` (``"heads"``, on a mesh whose data and fsdp axes are 1).

    Yields:
      ``[batch]`` int32 numpy arrays, one per step: each sequence's new token, or -1 once
      the sequence has stopped.

    Raises:
      pf.InvalidInputError: an empty or out-of-vocabulary prompt, a prompt that does not fit
        in ``max_len``, a missing key for sampling, a mesh that does not divide the model
        or the batch, an unknown ``kv_cache``, or a bad ``kv_dtype``, ``page_size`` or
        ``kv_split``.
    """
    prompts = _check_prompts(prompts, config)
    if max_new_tokens < 1:
        raise pf.InvalidInputError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    if sampling.temperature > 0 and key is None:
        raise pf.InvalidInputError("key: sampling with temperature > 0 needs a jax.random.key")
    key = jax.random.key(0) if key is None else key
    stop = np.asarray(config.eos_ids if stop_tokens is None else stop_tokens, np.int32)
    longest = max(len(p) for p in prompts)
    if kv_cache not in KV_CACHES:
        raise pf.InvalidInputError(f"kv_cache: expected one of {KV_CACHES}, got {kv_cache!r}")
    paged = kv_cache == "paged"
    if kv_split is None:
        kv_split = "sequence" if paged else "heads"
    check_split(kv_split, paged, mesh)
    devices = 1 if mesh is None or kv_split == "heads" else mesh.size
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
    cache = init_cache(
        config,
        len(prompts),
        max_len,
        mesh,
        kv_dtype=kv_dtype,
        page_size=page_size if paged else None,
        split=kv_split,
    )
    logits, cache = prefill(p, cache, tokens, lengths, config, backend, mesh)
    done = np.zeros(len(prompts), bool)
    for step in range(budget):
        key, subkey = jax.random.split(key)
        next_tokens = sample(logits, subkey, sampling)
        host = to_host(next_tokens)
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
