"""Generation on a paged and on an int8 cache: the same tokens as the contiguous cache (paged),
logits close to it (int8), pages allocated per sequence, the pool updated in place."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_llama import generation as gen
from pallas_flash_llama import sharding
from pallas_flash_llama.kv_cache import init_cache
from pallas_flash_llama.weights import load_params

PAGE = 8
PROMPTS = [[1, 5, 9, 33, 102], [1, *range(3, 10)], [1, *range(3, 20)]]
"""5 tokens (its 9th position, fed at the 4th decode step, opens a second page), 8 (ends on a
page boundary: the first decode step allocates its second page) and 18 (three pages)."""
NEW_TOKENS = 6
MAX_LEN, WIDTH = 128, 32
"""`generate`'s cache length and prompt width for these prompts (so its compiles are shared)."""
INT8_LOGIT_TOLERANCE = 0.1
"""Largest |logit| difference allowed between an int8 and a bfloat16 cache (bfloat16 compute,
|logits| up to 4.1): 0.067 measured, contiguous and paged alike (float32 compute: 0.042)."""


@pytest.fixture(scope="module")
def tiny(hf_dir):
    config, params = load_params(hf_dir[0])
    return config.replace(dtype="float32"), params


@pytest.fixture(scope="module")
def contiguous_tokens(tiny) -> list[list[int]]:
    config, params = tiny
    return _generate(params, config)


def _generate(params, config, decode_backend: str = "xla", **kwargs) -> list[list[int]]:
    return gen.generate_all(
        params, config, PROMPTS, max_new_tokens=NEW_TOKENS, stop_tokens=[], backend="xla",
        decode_backend=decode_backend, **kwargs,
    )  # fmt: skip


def _prompt_batch() -> tuple[np.ndarray, np.ndarray]:
    tokens = np.zeros((len(PROMPTS), WIDTH), np.int32)
    for i, prompt in enumerate(PROMPTS):
        tokens[i, : len(prompt)] = prompt
    return tokens, np.array([len(p) for p in PROMPTS], np.int32)


def _feed(step: int) -> jax.Array:
    return jnp.array([(7 * step + 3 * i) % 512 for i in range(len(PROMPTS))], jnp.int32)


@pytest.mark.parametrize("decode_backend", ["xla", "splitkv"])
def test_a_paged_cache_generates_the_contiguous_cache_s_tokens(
    tiny, contiguous_tokens, decode_backend
) -> None:
    config, params = tiny
    paged = _generate(params, config, decode_backend, kv_cache="paged", page_size=PAGE)
    assert paged == contiguous_tokens


def _prefilled(params, config):
    """The prompt batch prefilled (xla) into a paged cache and a contiguous one: (inference
    params, paged, contiguous, prompt lengths)."""
    p = gen.inference_params(params, config)
    tokens, lengths = _prompt_batch()
    paged = init_cache(config, 3, MAX_LEN, page_size=PAGE)
    contiguous = init_cache(config, 3, MAX_LEN)
    _, paged = gen.prefill(p, paged, tokens, lengths, config, "xla")
    _, contiguous = gen.prefill(p, contiguous, tokens, lengths, config, "xla")
    return p, paged, contiguous, lengths


def _positions(pool: np.ndarray, pages: np.ndarray, n: int, config) -> np.ndarray:
    """A sequence's first ``n`` positions ``[kv_heads, n, head_dim]`` from its ``pages`` of
    ``pool [num_pages, kv_heads, PAGE, head_dim]``."""
    held = np.moveaxis(pool[pages], 0, 1)  # [heads, pages, PAGE, dim]
    return held.reshape(config.kv_heads, -1, config.head_dim)[:, :n]


def test_pages_are_allocated_per_sequence_and_written_in_place(tiny) -> None:
    """Prefill takes ceil(length / page) pages per prompt; a decode step takes a page for each
    sequence at a page boundary, writes into the donated pool, and the pages read through the
    table hold what the contiguous cache holds."""
    config, params = tiny
    p, paged, contiguous, lengths = _prefilled(params, config)
    num_pages = paged.k[0].shape[0]
    assert num_pages == 3 * MAX_LEN // PAGE
    held = [math.ceil(n / PAGE) for n in lengths]  # 1, 1, 3
    for step in range(4):
        table = np.asarray(paged.pages.page_table)
        assert ((table >= 0).sum(axis=1)).tolist() == held
        assert int(paged.pages.num_free[0]) == num_pages - sum(held)
        previous = paged
        _, paged = gen.decode_step(p, paged, _feed(step), config, "xla")
        _, contiguous = gen.decode_step(p, contiguous, _feed(step), config, "xla")
        assert previous.k[0].is_deleted() and previous.v[-1].is_deleted(), "pool not donated"
        held = [math.ceil((n + step + 1) / PAGE) for n in lengths]
    assert held == [2, 2, 3]  # the 5-token prompt crossed into its second page, at step 3
    np.testing.assert_array_equal(paged.lengths, lengths + 4)
    table = np.asarray(paged.pages.page_table)
    assert len(set(table[table >= 0].tolist())) == sum(held), "a page held twice"
    for layer in range(config.layers):
        for b, n in enumerate(np.asarray(paged.lengths)):
            k = _positions(np.asarray(paged.k[layer]), table[b, : held[b]], n, config)
            np.testing.assert_array_equal(k, np.asarray(contiguous.k[layer])[b, :, :n])


def _decode_logits(params, config, **cache_kwargs) -> np.ndarray:
    """Logits of four decode steps after the prompts, ``[steps, batch, vocab]``."""
    p = gen.inference_params(params, config)
    tokens, lengths = _prompt_batch()
    cache = init_cache(config, 3, MAX_LEN, **cache_kwargs)
    _, cache = gen.prefill(p, cache, tokens, lengths, config, "xla")
    steps = []
    for step in range(4):
        logits, cache = gen.decode_step(p, cache, _feed(step), config, "xla")
        steps.append(np.asarray(logits))
    return np.stack(steps)


def test_int8_caches_give_logits_close_to_the_bfloat16_cache_s(tiny) -> None:
    config, params = tiny
    config = config.replace(dtype="bfloat16")
    reference = _decode_logits(params, config)
    contiguous = _decode_logits(params, config, kv_dtype=jnp.int8)
    paged = _decode_logits(params, config, kv_dtype=jnp.int8, page_size=PAGE)
    for int8 in (contiguous, paged):
        assert 0 < np.abs(int8 - reference).max() < INT8_LOGIT_TOLERANCE
    np.testing.assert_allclose(paged, contiguous, atol=1e-5)


def test_a_bfloat16_paged_cache_is_packed_and_decodes_as_the_contiguous_one(tiny) -> None:
    """A 16-bit paged cache keeps each layer's keys and values in one uint32 pool
    (`pallas_flash.kv_packing`); written by prefill and four decode steps, it gives the
    contiguous bfloat16 cache's logits (packing loses no bit), and its pages unpacked hold
    the contiguous cache's keys and values."""
    config, params = tiny
    config = config.replace(dtype="bfloat16")  # the compiles of the test above
    cache = init_cache(config, 3, MAX_LEN, page_size=PAGE)
    assert cache.packed and cache.v is None and cache.k[0].dtype == jnp.uint32
    assert cache.k[0].shape == (3 * MAX_LEN // PAGE, config.kv_heads, PAGE, config.head_dim)
    np.testing.assert_array_equal(
        _decode_logits(params, config, page_size=PAGE), _decode_logits(params, config)
    )
    _, paged, contiguous, lengths = _prefilled(params, config)
    table = np.asarray(paged.pages.page_table)
    layer = paged.layer(config.layers - 1)
    k, v = (np.asarray(x, np.float32) for x in layer.unpacked(jnp.bfloat16)[:2])
    for b, n in enumerate(np.asarray(lengths)):
        for pool, want in ((k, contiguous.k[-1]), (v, contiguous.v[-1])):
            got = _positions(pool, table[b, : -(-int(n) // PAGE)], n, config)
            np.testing.assert_array_equal(got, np.asarray(want, np.float32)[b, :, :n])


@pytest.mark.parametrize("kv_cache, decode_backend", [("contiguous", "xla"), ("paged", "splitkv")])
def test_int8_caches_generate_end_to_end(tiny, kv_cache, decode_backend) -> None:
    config, params = tiny
    config = config.replace(dtype="bfloat16")  # the compiles of the test above
    out = _generate(
        params, config, decode_backend, kv_cache=kv_cache, kv_dtype="int8", page_size=PAGE
    )
    assert [len(new) for new in out] == [NEW_TOKENS] * len(PROMPTS)
    assert all(0 <= t < config.vocab for new in out for t in new)


def test_the_paged_decode_step_updates_every_pool_in_place(tiny) -> None:
    """Compiled (here, for the CPU), the int8 paged decode step aliases every layer's pool and
    scales to its output and copies none of them (the TPU compile: test_aot)."""
    config, params = tiny
    p = gen.inference_params(params, config)
    cache = init_cache(config, 3, 4096, kv_dtype=jnp.int8, page_size=PAGE)
    tokens = jnp.zeros((3,), jnp.int32)
    compiled = gen.jitted("decode", cache, config, "xla").lower(p, cache, tokens).compile()
    pool = cache.k[0].nbytes + cache.k_scales[0].nbytes
    assert compiled.memory_analysis().alias_size_in_bytes >= 2 * config.layers * pool
    pools = [f"= {kind}[{','.join(map(str, x.shape))}]{{" for kind, x in
             (("s8", cache.k[0]), ("f32", cache.k_scales[0]))]  # fmt: skip
    text = compiled.as_text().splitlines()
    copies = [line for line in text if " copy(" in line and any(p in line for p in pools)]
    assert not copies, copies


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"kv_cache": "ring"}, pf.InvalidInputError, "kv_cache: expected one of"),
        ({"kv_dtype": "int32"}, pf.InvalidInputError, "kv_dtype: expected"),
        ({"kv_dtype": "int4x"}, pf.InvalidInputError, "kv_dtype: expected"),
        ({"kv_cache": "paged", "page_size": 0}, pf.InvalidInputError, "page_size: expected"),
        ({"kv_split": "rows"}, pf.InvalidInputError, "split: expected one of"),
        (
            {"kv_cache": "paged", "kv_split": "heads", "mesh": "1,2,2"},
            pf.InvalidInputError,
            "data and fsdp axes are 1",
        ),
    ],
)
def test_bad_cache_options_are_named(tiny, kwargs, error, message) -> None:
    config, params = tiny
    if "mesh" in kwargs:
        kwargs["mesh"] = sharding.make_mesh(*map(int, kwargs["mesh"].split(",")))
    with pytest.raises(error, match=message):
        gen.generate_all(params, config, [[1, 2]], max_new_tokens=2, backend="xla", **kwargs)


@pytest.mark.parametrize("kv_dtype", [None, jnp.int8], ids=["float", "int8"])
@pytest.mark.parametrize("split", ["sequence", "heads"])
def test_a_paged_cache_over_a_mesh_generates_one_device_s_tokens(hf_dir, kv_dtype, split) -> None:
    """Over 2 devices, pages split (each sequence's pages round them, written and read where
    they are) or kv heads split (each device every page of its head): the tokens of the same
    paged cache on one device."""
    mesh = sharding.make_mesh(1, 1, 2, devices=jax.devices()[:2])
    kwargs = dict(kv_cache="paged", page_size=PAGE, kv_dtype=kv_dtype)
    config, params = load_params(hf_dir[0])
    config = config.replace(dtype="float32")
    want = _generate(params, config, "splitkv", **kwargs)
    _, sharded = load_params(hf_dir[0], config, mesh=mesh)
    assert _generate(sharded, config, "splitkv", mesh=mesh, kv_split=split, **kwargs) == want
    cache = init_cache(config, len(PROMPTS), MAX_LEN, mesh, page_size=PAGE, kv_dtype=kv_dtype,
                       split=split)  # fmt: skip
    shard = cache.k[0].sharding.shard_shape(cache.k[0].shape)
    if split == "sequence":
        assert cache.pages.shards == 2
        assert shard[:2] == (cache.k[0].shape[0] // 2, config.kv_heads)
    else:
        assert cache.pages.shards == 1
        assert shard[:2] == (cache.k[0].shape[0], config.kv_heads // 2)
