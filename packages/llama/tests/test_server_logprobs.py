"""Logprobs through the server (`openai_logprobs`): completions' ``logprobs`` (streamed and
not), ``echo`` with the prompt's, vLLM's ``prompt_logprobs``, chat's ``logprobs`` and
``top_logprobs``, in the shapes the ``openai`` client reads; and, on the real engine with the
tiny model, a loglikelihood as lm-evaluation-harness's ``local-completions`` asks for it
(``echo``, ``logprobs: 1``) against float64 log-softmax of the model's own logits."""

from __future__ import annotations

import pathlib

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from server_testing import MODEL, fake_logprob, serving

from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.model import forward
from pallas_flash_llama.server import make_app
from pallas_flash_llama.tokenizer import load_tokenizer
from pallas_flash_llama.weights import load_params


@pytest.fixture(scope="module")
def text_of(model_dir: tuple[pathlib.Path, LlamaConfig]):
    tokenizer = load_tokenizer(model_dir[0])
    return lambda token: tokenizer.decode([token])


def _ids(model_dir: tuple, text: str) -> list[int]:
    return [1, *load_tokenizer(model_dir[0]).encode(text).ids]  # bos, then the text's


def _expected(tokens: list[int], count: int, text_of, offset: int = 0) -> dict:
    """The completions logprobs `FakeEngine` makes for ``tokens`` (`fake_logprob`)."""
    scores = [fake_logprob(t, count) for t in tokens]
    tops = [{**{text_of(a): v for a, v in s.top}, text_of(s.token): s.logprob} for s in scores]
    offsets = np.cumsum([offset] + [len(text_of(t)) for t in tokens])[:-1].tolist()
    return {"tokens": [text_of(t) for t in tokens], "token_logprobs": [s.logprob for s in scores],
            "top_logprobs": tops, "text_offset": offsets}  # fmt: skip


def test_completion_logprobs_whole_and_streamed(client, model_dir, text_of) -> None:
    prompt = _ids(model_dir, "The quick brown")  # the fake engine echoes these
    reply = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=4,
                                      logprobs=2)  # fmt: skip
    assert reply.choices[0].logprobs.model_dump() == _expected(prompt[:4], 2, text_of)
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown",
                                            max_tokens=4, logprobs=2, stream=True))  # fmt: skip
    streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}  # fmt: skip
    for chunk in chunks:
        for name, values in (chunk.choices[0].logprobs.model_dump() or {}).items():
            streamed[name] += values
    assert streamed == _expected(prompt[:4], 2, text_of)


def test_echo_leads_with_the_prompt_and_its_logprobs(client, fake, model_dir, text_of) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt's tokens scored, the first
    with none, then the completion's."""
    prompt = _ids(model_dir, "Once upon")
    reply = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=1,
                                      logprobs=1, echo=True, temperature=0)  # fmt: skip
    (choice,) = reply.choices
    generated = prompt[:1]  # the fake engine's first token: the prompt's first
    assert choice.text == "Once upon" + "".join(map(text_of, generated))
    expected = _expected(prompt + generated, 1, text_of)
    expected["token_logprobs"][0] = expected["top_logprobs"][0] = None
    assert choice.logprobs.model_dump() == expected
    request = next(r for r in fake.submitted if r.id == reply.id)
    assert (request.logprobs, request.prompt_logprobs) == (1, 1)
    echoed = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=1, echo=True)
    assert echoed.choices[0].text.startswith("Once upon") and echoed.choices[0].logprobs is None


def test_vllm_s_prompt_logprobs_by_token_id(url, model_dir, text_of) -> None:
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 1, "prompt_logprobs": 2}
    (choice,) = httpx.post(f"{url}/v1/completions", json=body).json()["choices"]
    prompt = _ids(model_dir, "The quick")
    assert len(choice["prompt_logprobs"]) == len(prompt) and choice["prompt_logprobs"][0] is None
    for token, found in zip(prompt[1:], choice["prompt_logprobs"][1:], strict=True):
        score = fake_logprob(token, 2)
        ranked = [(token + 1, score.top[0][1], 1), (token + 2, score.top[1][1], 2),
                  (token, score.logprob, 2)]  # fmt: skip
        assert found == {str(t): {"logprob": value, "rank": rank, "decoded_token": text_of(t)}
                         for t, value, rank in ranked}  # fmt: skip


def test_chat_logprobs_and_top_logprobs(client, fake, url, text_of) -> None:
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                           logprobs=True, top_logprobs=2)  # fmt: skip
    content = reply.choices[0].logprobs.content
    generated = next(r for r in fake.submitted if r.id == reply.id).prompt[:3]  # echoed
    assert len(content) == 3
    for entry, token in zip(content, generated, strict=True):
        score = fake_logprob(token, 2)
        assert (entry.token, entry.logprob) == (text_of(token), score.logprob)
        assert entry.bytes == list(entry.token.encode())
        assert [(a.token, a.logprob) for a in entry.top_logprobs] == [
            (text_of(t), v) for t, v in score.top
        ]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                                 logprobs=True, stream=True))  # fmt: skip
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)  # logprobs alone: no alternatives
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert plain.choices[0].logprobs is None
    bad = httpx.post(f"{url}/v1/chat/completions",
                     json={"model": MODEL, "messages": messages, "top_logprobs": 2})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"


def test_a_loglikelihood_on_the_real_engine_is_the_model_s(model_dir) -> None:
    """As ``lm_eval --model local-completions`` scores a continuation: ``echo``, ``logprobs:
    1``, ``max_tokens: 1``, greedy; the prompt's token logprobs against float64 log-softmax of
    the model's logits, and each one's greediness against their argmax."""
    from pallas_flash_llama.engine import Engine

    directory, _ = model_dir
    config, params = load_params(directory)
    config = config.replace(dtype="float32")  # the served model's and the reference's
    engine = Engine(params, config, slots=2, token_budget=16, page_size=16, num_pages=32,
                    pages_per_sequence=16, backend="xla")  # fmt: skip
    text = "The quick brown fox jumps over the lazy dog."
    prompt = _ids(model_dir, text)
    engine.start()
    try:
        with serving(make_app(engine, directory, config, model_name=MODEL)) as address:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "logprobs": 1, "echo": True}  # fmt: skip
            reply = httpx.post(f"{address}/v1/completions", json=body, timeout=600).json()
    finally:
        engine.stop()
    logprobs = reply["choices"][0]["logprobs"]
    logits = forward(params, jnp.asarray([prompt], jnp.int32), config, backend="xla")[0]
    reference = scipy.special.log_softmax(np.asarray(logits, np.float64), axis=-1)
    assert logprobs["token_logprobs"][0] is None and len(logprobs["tokens"]) == len(prompt) + 1
    want = [reference[p - 1, prompt[p]] for p in range(1, len(prompt))]
    np.testing.assert_allclose(logprobs["token_logprobs"][1 : len(prompt)], want, atol=1e-4)
    tokenizer = load_tokenizer(directory)
    for p in range(1, len(prompt)):  # lm-eval's is_greedy: the top alternative is the token
        top = max(logprobs["top_logprobs"][p].items(), key=lambda item: item[1])[0]
        greedy = int(np.argmax(reference[p - 1]))
        assert (top == tokenizer.decode([prompt[p]])) == (greedy == prompt[p])
    # the generated token: the argmax after the whole prompt, scored as the model scores it
    np.testing.assert_allclose(logprobs["token_logprobs"][-1], reference[-1].max(), atol=1e-4)
