"""Generation: the cached decode equals re-running the whole sequence; sampling; errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_llama import generation as gen
from pallas_flash_llama import model
from pallas_flash_llama.kv_cache import init_cache
from pallas_flash_llama.sampling import Sampling
from pallas_flash_llama.weights import load_params

PROMPTS = [[1, 5, 9, 33, 102], [1, 7], [1, *range(3, 20)]]
"""Ragged prompts: 5, 2 and 18 tokens."""


@pytest.fixture(scope="module")
def tiny(hf_dir):
    config, params = load_params(hf_dir[0])
    return config.replace(dtype="float32"), params


def _full_logits(params, config, sequence: list[int]) -> np.ndarray:
    return np.asarray(model.forward(params, jnp.array([sequence]), config, backend="xla")[0])


@pytest.mark.parametrize("backend, decode_backend", [("xla", "xla"), ("pallas", "splitkv")])
def test_cached_decoding_equals_rerunning_the_sequence(tiny, backend, decode_backend) -> None:
    config, params = tiny
    p = gen.inference_params(params, config)
    tokens = np.zeros((3, 32), np.int32)
    for i, prompt in enumerate(PROMPTS):
        tokens[i, : len(prompt)] = prompt
    lengths = np.array([len(prompt) for prompt in PROMPTS], np.int32)
    cache = init_cache(config, 3, 128)
    logits, cache = gen.prefill(p, cache, tokens, lengths, config, backend)
    sequences = [list(prompt) for prompt in PROMPTS]
    for step in range(3):
        for i, seq in enumerate(sequences):
            want = _full_logits(params, config, seq)[-1]
            np.testing.assert_allclose(np.asarray(logits[i]), want, rtol=1e-4, atol=1e-4)
        feed = jnp.array([(7 * step + 3 * i) % config.vocab for i in range(3)], jnp.int32)
        previous = cache
        logits, cache = gen.decode_step(p, cache, feed, config, decode_backend)
        assert previous.k[0].is_deleted(), "the cache must be donated (written in place)"
        for seq, token in zip(sequences, feed.tolist(), strict=True):
            seq.append(token)
    assert cache.lengths.tolist() == [len(s) for s in sequences]


def test_greedy_generation_is_the_argmax_of_the_full_sequence(tiny) -> None:
    config, params = tiny
    outputs = gen.generate_all(
        params,
        config,
        PROMPTS,
        max_new_tokens=5,
        stop_tokens=[],
        backend="xla",
        decode_backend="xla",
    )
    for prompt, new in zip(PROMPTS, outputs, strict=True):
        assert len(new) == 5
        sequence = list(prompt)
        for token in new:
            assert token == int(np.argmax(_full_logits(params, config, sequence)[-1]))
            sequence.append(token)


def test_steps_stream_and_stop_tokens_end_a_sequence(tiny) -> None:
    config, params = tiny
    free = gen.generate_all(
        params,
        config,
        PROMPTS,
        max_new_tokens=4,
        stop_tokens=[],
        backend="xla",
        decode_backend="xla",
    )
    stop = free[0][1]  # the first sequence's second token
    steps = list(
        gen.generate(
            params,
            config,
            PROMPTS,
            max_new_tokens=4,
            stop_tokens=[stop],
            backend="xla",
            decode_backend="xla",
        )
    )
    assert all(step.shape == (3,) and step.dtype == np.int32 for step in steps)
    first = [int(step[0]) for step in steps]
    cut = free[0].index(stop) + 1
    assert first[:cut] == free[0][:cut] and set(first[cut:]) <= {-1}


def test_generation_stops_when_the_cache_is_full(tiny) -> None:
    config, params = tiny
    out = gen.generate_all(
        params,
        config,
        [[1, 2, 3]],
        max_new_tokens=50,
        stop_tokens=[],
        max_len=8,
        backend="xla",
        decode_backend="xla",
    )
    assert len(out[0]) == 6  # positions 3..7 hold fed-back tokens, the last is not fed back


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([[1] * 20], {"max_len": 16}, "max_len"),
        ([[1], []], {}, r"prompts\[1\]"),
        ([[1, 9999]], {}, r"prompts\[0\].*9999"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens"),
        ([[1]], {"sampling": Sampling(temperature=1.0)}, "key"),
    ],
)
def test_bad_generation_input_is_named(tiny, prompts, kwargs, message) -> None:
    config, params = tiny
    kwargs = {"max_new_tokens": 2} | kwargs
    with pytest.raises(pf.InvalidInputError, match=message):
        gen.generate_all(params, config, prompts, backend="xla", decode_backend="xla", **kwargs)
