"""vLLM's logit edits (`logit_processing`): ``logit_bias``, ``min_tokens``, the presence,
frequency and repetition penalties and ``min_p``, against a NumPy reference written from
vLLM's code (``vllm/model_executor/layers/utils.py:apply_penalties``, the v1 sampler's
``MinTokensLogitsProcessor``, ``LogitBiasLogitsProcessor`` and ``MinPLogitsProcessor``), on
random logits and through the engine's greedy tokens."""

from __future__ import annotations

import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_llama.config import get_config
from pallas_flash_llama.engine import Engine
from pallas_flash_llama.logit_processing import LogitEdits, LogitProcessing, apply_edits
from pallas_flash_llama.model import forward, init_params
from pallas_flash_llama.scheduler import Request

VOCAB = 64


def vllm_edits(logits: np.ndarray, prompt: list[int], output: list[int],
               processing: LogitProcessing, stop_ids: list[int],
               temperature: float) -> np.ndarray:  # fmt: skip
    """One row of logits edited as vLLM's v1 sampler edits it, in float64."""
    logits = logits.astype(np.float64).copy()
    for token, bias in processing.logit_bias:  # LogitBiasLogitsProcessor
        logits[token] += bias
    if len(output) < processing.min_tokens:  # MinTokensLogitsProcessor
        logits[stop_ids] = -np.inf
    counts = np.bincount(output, minlength=len(logits))  # apply_penalties
    output_mask, prompt_mask = counts > 0, np.bincount(prompt, minlength=len(logits)) > 0
    penalty = np.where(prompt_mask | output_mask, processing.repetition_penalty, 1.0)
    logits = np.where(logits > 0, logits / penalty, logits * penalty)
    logits -= processing.frequency_penalty * counts
    logits -= processing.presence_penalty * output_mask
    if temperature > 0 and processing.min_p > 0:  # MinPLogitsProcessor, after the temperature
        probs = np.exp(logits / temperature - np.max(logits / temperature))
        probs /= probs.sum()
        logits = np.where(probs < processing.min_p * probs.max(), -np.inf, logits)
    return logits


CASES = [
    LogitProcessing(logit_bias=((3, 5.0), (7, -100.0))),
    LogitProcessing(min_tokens=4),
    LogitProcessing(presence_penalty=1.5, frequency_penalty=0.5),
    LogitProcessing(repetition_penalty=1.3),
    LogitProcessing(repetition_penalty=0.7, frequency_penalty=-0.4, logit_bias=((9, 2.0),)),
    LogitProcessing(min_p=0.2),
    LogitProcessing(min_p=0.05, presence_penalty=-1.0, min_tokens=9),
]


@pytest.mark.parametrize("processing", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_edits_are_vllm_s_on_random_logits(processing: LogitProcessing, temperature) -> None:
    rng = np.random.default_rng(0)
    prompt, stop_ids = rng.integers(0, VOCAB, 12).tolist(), [2, 5]
    outputs = [rng.integers(0, VOCAB, n).tolist() for n in (0, 3, 8)]  # one slot each
    logits = rng.normal(0, 3, (len(outputs), VOCAB)).astype(np.float32)
    rows = [(slot, processing, processing.tokens_edited(frozenset(prompt), Counter(out), stop_ids))
            for slot, out in enumerate(outputs)]  # fmt: skip
    edits = LogitEdits.build(len(outputs), rows)
    temperatures = jnp.full(len(outputs), temperature, jnp.float32)
    got = np.asarray(apply_edits(jnp.asarray(logits), jax.tree.map(jnp.asarray, edits),
                                 temperatures))  # fmt: skip
    for slot, out in enumerate(outputs):
        want = vllm_edits(logits[slot], prompt, out, processing, stop_ids, temperature)
        np.testing.assert_array_equal(np.isinf(got[slot]), np.isinf(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[slot][finite], want[finite], rtol=1e-5, atol=1e-5)


def test_the_engine_s_greedy_tokens_follow_the_edited_logits() -> None:
    """Greedy tokens with a penalty, a bias and ``min_tokens`` beside an unedited request
    (the same step program) are the argmax of the reference's edits of the model's logits."""
    config = get_config("tiny").replace(dtype="float32")
    params = init_params(config, jax.random.key(0))
    engine = Engine(params, config, slots=2, token_budget=16, page_size=4, num_pages=24,
                    pages_per_sequence=8, backend="xla")  # fmt: skip
    prompt, stop_ids = (5, 9, 5, 11, 3), (2, 11)
    processing = LogitProcessing(logit_bias=((17, 3.0),), min_tokens=3, presence_penalty=2.0,
                                 frequency_penalty=0.5, repetition_penalty=1.5)  # fmt: skip
    edited = Request("edited", prompt, 8, stop_ids=stop_ids, processing=processing)
    plain = Request("plain", prompt, 8)
    done = engine.run_all([edited, plain])
    assert done["plain"].tokens == engine.run_all([Request("alone", prompt, 8)])["alone"].tokens
    output: list[int] = []
    for _ in range(8):
        logits = forward(params, jnp.asarray([[*prompt, *output]], jnp.int32), config,
                         backend="xla")[0, -1]  # fmt: skip
        row = vllm_edits(np.asarray(logits), list(prompt), output, processing, list(stop_ids), 0)
        output.append(int(np.argmax(row)))
        if output[-1] in stop_ids:
            break
    assert list(done["edited"].tokens) == output
    assert done["edited"].tokens != done["plain"].tokens


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_tokens": -1}, "min_tokens: expected >= 0"),
        ({"presence_penalty": 3}, "presence_penalty: expected -2 to 2"),
        ({"repetition_penalty": 0}, "repetition_penalty: expected > 0"),
        ({"min_p": 1.5}, "min_p: expected 0 to 1"),
    ],
)
def test_bad_settings_name_their_field(fields: dict, message: str) -> None:
    with pytest.raises(pf.InvalidInputError, match=message):
        LogitProcessing(**fields)
    held_back = LogitProcessing(min_tokens=1).tokens_edited(frozenset(), Counter(), [4])
    assert math.isinf(held_back[4][0])
