"""The OpenAI-compatible server (`pallas_flash_llama.server`) through the real ``openai`` client.

uvicorn serves the app on 127.0.0.1 in a background thread. The engine is `FakeEngine`, which
echoes each prompt's token ids back (cyclically) from its own thread, so these tests check the
server alone; `test_real_engine_tiny_model` and `test_real_engine_load` run the flow and the
load test against the real engine with the tiny model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import shutil
import statistics
import sys
import time
import types
from collections.abc import Callable

import httpx
import openai
import pytest
import uvicorn
from llama_testing import HANG_S
from server_testing import JSON, MODEL, FakeEngine, serving

from pallas_flash_llama import cli
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.logit_processing import LogitProcessing
from pallas_flash_llama.scheduler import Request
from pallas_flash_llama.server import make_app
from pallas_flash_llama.text_stream import TextStream
from pallas_flash_llama.tokenizer import TOKENIZER_FILE, load_tokenizer
from pallas_flash_llama.weights import load_params


@pytest.fixture(scope="module")
def ids(model_dir: tuple[pathlib.Path, LlamaConfig]) -> Callable[[str], list[int]]:
    """A text's ids as the server encodes a prompt: bos, then the text's."""
    tokenizer = load_tokenizer(model_dir[0])
    return lambda text: [1, *tokenizer.encode(text).ids]


def _request(fake: FakeEngine, request_id: str) -> Request:
    return next(r for r in fake.submitted if r.id == request_id)


def test_completion(client: openai.OpenAI, fake: FakeEngine, ids: Callable) -> None:
    prompt = ids("The quick brown fox")
    reply = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=len(prompt), temperature=0, seed=3
    )
    assert reply.object == "text_completion" and reply.model == MODEL
    assert reply.choices[0].text == "The quick brown fox"  # the echo, bos not shown
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), len(prompt))
    request = _request(fake, reply.id)
    assert request.prompt == tuple(prompt) and request.seed == 3
    assert request.sampling.temperature == 0 and 2 in request.stop_ids  # eos


def test_completion_of_token_ids_and_eos(client: openai.OpenAI, ids: Callable) -> None:
    words = ids("The quick")[1:]
    reply = client.completions.create(model=MODEL, prompt=[*words, 2, 7], max_tokens=10)
    assert reply.choices[0].text == "The quick"  # eos (2) ended it, not in the text
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(words) + 1


def test_streamed_completion(client: openai.OpenAI, ids: Callable) -> None:
    text = "Once upon a time café ü"
    chunks = list(
        client.completions.create(model=MODEL, prompt=text, max_tokens=len(ids(text)), stream=True)
    )
    assert all(chunk.object == "text_completion" for chunk in chunks)
    assert "".join(chunk.choices[0].text for chunk in chunks) == text
    assert not any("\ufffd" in chunk.choices[0].text for chunk in chunks)
    assert [chunk.choices[0].finish_reason for chunk in chunks][-2:] == [None, "length"]
    assert len(chunks) > 5  # a piece per token, not one at the end


def test_stop_strings(client: openai.OpenAI, fake: FakeEngine, model_dir: tuple) -> None:
    prompt = "The quick brown fox jumps over"
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stop=" fox")
    assert (one.choices[0].text, one.choices[0].finish_reason) == ("The quick brown", "stop")
    (fox,) = load_tokenizer(model_dir[0]).encode(" fox").ids  # one token: the engine stops
    assert fox in _request(fake, one.id).stop_ids and one.id not in fake.cancelled

    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, stop=["x ju", "never"], stream=True
    )
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks) == "The quick brown fo"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].id in fake.cancelled  # found in the text: the request is cancelled


def _wait_for(condition: Callable[[], object], timeout: float = HANG_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_chat(client: openai.OpenAI, fake: FakeEngine, ids: Callable) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]},
    ]
    rendered = "system: Be brief.\nuser: The quick brown fox\nassistant:"
    prompt = ids(rendered)  # the template's <s>, then the text: no second bos
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=len(prompt)
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == rendered  # the echo
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(prompt)
    assert _request(fake, reply.id).prompt == tuple(prompt)

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=20,
            stream=True,
            stop=["\n"],
            stream_options={"include_usage": True},
        )
    )
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == "system: Be brief."  # stopped at the newline
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(prompt)


def test_chat_template_refusal(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="no tool messages here"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]
        )


def test_no_chat_template(model_dir: tuple, fake: FakeEngine, tmp_path: pathlib.Path) -> None:
    shutil.copy(model_dir[0] / TOKENIZER_FILE, tmp_path / TOKENIZER_FILE)
    with serving(make_app(fake, tmp_path, model_dir[1], model_name=MODEL)) as address:
        bare = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="has no chat template") as error:
            bare.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert error.value.body["param"] == "messages"
        plain = bare.completions.create(model=MODEL, prompt="The", max_tokens=2)
        assert plain.usage.prompt_tokens == 2  # no tokenizer_config.json: config's bos leads


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "does not exist"),
        ({"model": MODEL, "prompt": "hi", "n": 17}, 400, "n", "less than or equal to 16"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n", "greater than or equal to 1"),
        ({"model": MODEL, "prompt": [5] * 300}, 400, "prompt", "maximum context length is 256"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 300}, 400, "max_tokens", "256"),
        ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
        ({"model": MODEL, "prompt": [5, 9999]}, 400, "prompt", "token ids must be in"),
        (
            {"model": MODEL, "prompt": "hi", "temperature": -1},
            400,
            "temperature",
            "greater than or equal to 0",
        ),
        ({"model": MODEL, "prompt": "hi", "stop": ""}, 400, "stop", "non-empty"),
        ({"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs", "or equal to 20"),
        (
            {"model": MODEL, "prompt": "hi", "prompt_logprobs": 1, "stream": True},
            400,
            "prompt_logprobs",
            "prompt_logprobs: not supported with stream",
        ),
        (
            {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 1, "stream": True},
            400,
            "echo",
            "echo: with logprobs, not supported with stream",
        ),
        ({"model": MODEL, "prompt": "hi", "presence_penalty": 99}, 400, "presence_penalty", "2"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"a": 1}}, 400, "logit_bias", "ids as"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"9999": 1}}, 400, "logit_bias", "[0,"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "100]"),
        ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", ""),
        ({"model": MODEL, "prompt": "hi", "min_p": 2}, 400, "min_p", "less than or equal to 1"),
        (
            {"model": MODEL, "prompt": "hi", "min_tokens": 5, "max_tokens": 2},
            400,
            "min_tokens",
            "at most max_tokens (2)",
        ),
        (
            {"model": MODEL, "prompt": "hi", "response_format": {"type": "json_object"}},
            400,
            "response_format",
            "not supported",
        ),
        ({"model": MODEL, "prompt": "hi", "guided_json": {}}, 400, "guided_json", ""),
        ({"model": MODEL, "prompt": "hi", "frobnicate": 1}, 400, "frobnicate", "Unrecognized"),
        ({"model": MODEL, "prompt": "hi", "stop_token_ids": [9999]}, 400, "stop_token_ids", ""),
        ({"model": MODEL, "prompt": "a\ud800b"}, 400, "prompt", "lone surrogate '\\ud800' at"),
        ({"model": MODEL, "prompt": "hi", "stop": "\udfff"}, 400, "stop", "invalid Unicode"),
    ],
)
def test_errors(url: str, body: dict, status: int, param: str | None, message: str) -> None:
    # json.dumps escapes a lone surrogate (\\ud800), as a client's JSON may hold it
    reply = httpx.post(f"{url}/v1/completions", content=json.dumps(body), headers=JSON)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_fields_that_ask_for_nothing_are_accepted(client: openai.OpenAI) -> None:
    """No-op values of fields not served, and fields that only name or file the request."""
    noop = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "echo": False,
            "response_format": {"type": "text"}, "min_tokens": 0, "repetition_penalty": 1.0,
            "user": "me", "metadata": {"a": "b"}, "best_of": 1, "logprobs": None}  # fmt: skip
    reply = client.completions.create(model=MODEL, prompt="The quick", max_tokens=2,
                                      extra_body=noop)  # fmt: skip
    assert reply.choices[0].finish_reason == "length"


def test_chat_refuses_what_it_does_not_serve(client: openai.OpenAI, url: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="tools: not supported") as refused:
        client.chat.completions.create(
            model=MODEL, messages=messages,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )  # fmt: skip
    assert refused.value.body["param"] == "tools"
    lone = {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800"}]}
    reply = httpx.post(f"{url}/v1/chat/completions", content=json.dumps(lone), headers=JSON)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
    assert "invalid Unicode" in reply.json()["error"]["message"]


def test_every_status_has_openai_s_error_body(url: str) -> None:
    for reply, status, message in [
        (httpx.post(f"{url}/v1/nothing", json={}), 404, "Invalid URL (POST /v1/nothing)"),
        (httpx.get(f"{url}/v1/completions"), 405, "Method not allowed (GET /v1/completions)"),
        (
            httpx.post(f"{url}/v1/completions", content=b'{"model": ', headers=JSON),
            400,
            "We could not parse the JSON body of your request",
        ),
    ]:
        assert reply.status_code == status
        error = reply.json()["error"]
        assert error["message"].startswith(message) and error["param"] is None
        assert set(error) == {"message", "type", "param", "code"}


def test_ignore_eos_and_stop_token_ids_as_vllm_s(
    client: openai.OpenAI, fake: FakeEngine, ids: Callable
) -> None:
    """vLLM's ``ignore_eos``: eos (2) does not end the request; ``stop_token_ids`` do, the
    stop token out of the text unless ``include_stop_str_in_output``."""
    words = ids("The quick brown")[1:]
    prompt = [*words, 2, 7]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10)
    assert plain.choices[0].finish_reason == "stop"
    ignoring = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    assert ignoring.choices[0].finish_reason == "length"
    assert ignoring.usage.completion_tokens == 10 and 2 not in _request(fake, ignoring.id).stop_ids

    brown = words[-1]
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                        extra_body={"stop_token_ids": [brown]})  # fmt: skip
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("The quick", "stop")
    assert brown in _request(fake, stopped.id).stop_ids
    kept = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10,
        extra_body={"stop_token_ids": [brown], "include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].text == "The quick brown"


def test_logit_edits_reach_the_engine(client: openai.OpenAI, fake: FakeEngine) -> None:
    """``logit_bias``, the penalties, ``min_p`` and ``min_tokens`` as the request's logit
    processing (`logit_processing`, whose tests hold its definitions against vLLM's); none
    asked, none sent."""
    edits = {"logit_bias": {"5": -100, "17": 2.5}, "presence_penalty": 0.5,
             "frequency_penalty": -0.25, "repetition_penalty": 1.2, "min_p": 0.1,
             "min_tokens": 2}  # fmt: skip
    reply = client.completions.create(model=MODEL, prompt="The quick", max_tokens=4,
                                      extra_body=edits)  # fmt: skip
    assert _request(fake, reply.id).processing == LogitProcessing(
        logit_bias=((5, -100.0), (17, 2.5)), min_tokens=2, presence_penalty=0.5,
        frequency_penalty=-0.25, repetition_penalty=1.2, min_p=0.1,
    )  # fmt: skip
    plain = client.completions.create(model=MODEL, prompt="The quick", max_tokens=1)
    assert _request(fake, plain.id).processing is None


def test_no_stop_string_within_min_tokens(client: openai.OpenAI) -> None:
    """vLLM's ``min_tokens``: a stop string in the text of the first ``min_tokens`` tokens
    does not end the request (the fake engine echoes the prompt, bos first: bos, The, quick,
    The, ...; the stop string spans tokens, so the text finds it, not the engine)."""
    prompt = "The quick The quick brown"
    early = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stop="k The")
    assert (early.choices[0].text, early.choices[0].finish_reason) == ("The quic", "stop")
    late = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stop="k The",
                                     extra_body={"min_tokens": 4})  # fmt: skip
    assert late.choices[0].text.startswith("The quick The quick brown")
    assert late.choices[0].finish_reason == "length"


def test_include_stop_str_in_output_keeps_the_stop_string(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox jumps over"
    for stream in (False, True):
        reply = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, stop=["x ju"], stream=stream,
            extra_body={"include_stop_str_in_output": True},
        )  # fmt: skip
        chunks = list(reply) if stream else [reply]
        assert "".join(c.choices[0].text for c in chunks) == "The quick brown fox ju"
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_errors_through_the_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="less than or equal to 16"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], n=17
        )


def test_n_choices(client: openai.OpenAI, fake: FakeEngine, ids: Callable) -> None:
    """Each choice is a sequence of its own, seeded seed + i; the usage counts the prompt
    once and every choice's tokens; streamed, each chunk names its choice."""
    prompt = ids("The quick brown fox")
    reply = client.completions.create(model=MODEL, prompt="The quick brown fox", n=3, seed=7,
                                      max_tokens=len(prompt))  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.text == "The quick brown fox" and c.finish_reason == "length"
               for c in reply.choices)  # fmt: skip
    requests = [_request(fake, reply.id), *(_request(fake, f"{reply.id}-{i}") for i in (1, 2))]
    assert [r.seed for r in requests] == [7, 8, 9]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        len(prompt), 3 * len(prompt))  # fmt: skip
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi there"}], n=2, max_tokens=6,
        stream=True))  # fmt: skip
    by_choice = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk.choices
        by_choice[choice.index].append(choice)
    for choices in by_choice.values():
        assert choices[0].delta.role == "assistant"
        assert choices[-1].finish_reason == "length"
    texts = ["".join(c.delta.content or "" for c in choices) for choices in by_choice.values()]
    assert texts[0] == texts[1] != ""  # the fake engine echoes the prompt, whatever the seed


def test_models_and_health(client: openai.OpenAI, url: str) -> None:
    (card,) = client.models.list().data
    assert (card.id, card.object, card.model_extra["max_model_len"]) == (MODEL, "model", 256)
    assert httpx.get(f"{url}/health").status_code == 200


def test_server_sent_events(url: str) -> None:
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = reply.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") for event in events[:-2])
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "length"


def test_disconnect_cancels(url: str, fake: FakeEngine) -> None:
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 250, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as reply:
        first = next(reply.iter_lines())
    request_id = json.loads(first.removeprefix("data: "))["id"]
    assert _wait_for(lambda: request_id in fake.cancelled)  # streamed: cancelled

    before = set(fake.cancelled)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{url}/v1/completions",
            timeout=0.2,
            json={"model": MODEL, "prompt": "Once", "max_tokens": 250},
        )
    assert _wait_for(lambda: set(fake.cancelled) - before)  # not streamed: cancelled too

    body = {**body, "n": 2}  # every choice of a request, streamed or not
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as reply:
        first = next(reply.iter_lines())
    request_id = json.loads(first.removeprefix("data: "))["id"]
    assert _wait_for(lambda: {request_id, f"{request_id}-1"} <= set(fake.cancelled))
    before = set(fake.cancelled)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", timeout=0.2, json={**body, "stream": False})
    assert _wait_for(lambda: len(set(fake.cancelled) - before) == 2)


def test_text_stream_holds_back_partial_text(model_dir: tuple) -> None:
    tokenizer = load_tokenizer(model_dir[0])
    text = TextStream(tokenizer, ("brown fox",), stop_ids=(2,))
    pieces = [text.push(token)[0] for token in tokenizer.encode("é the brown fax").ids]
    # é is two byte tokens: nothing until both are in; " brown", " brown f" may begin the stop
    assert pieces == ["", "é", " the", " ", "", "brown fax"]
    assert text.flush() == ""


async def _stream_all(url: str, prompts: list[str], tokens: int) -> tuple[list, float]:
    """Streams every prompt at once through the async openai client; returns per request its
    text, finish reason, time to first token and the gaps between its chunks, and the whole
    run's seconds. The client's first request (imports, a connection) runs before, untimed."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    async def one(prompt: str) -> tuple[str, str | None, float, list[float]]:
        start = time.perf_counter()
        stamps, pieces, reason = [], [], None
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=tokens, temperature=0, stream=True
        )
        async for chunk in stream:
            stamps.append(time.perf_counter())
            pieces.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason
        gaps = list(map(float.__sub__, stamps[1:], stamps[:-1]))
        return "".join(pieces), reason, stamps[0] - start, gaps

    try:
        await one(prompts[0])
        start = time.perf_counter()
        results = await asyncio.gather(*(one(prompt) for prompt in prompts))
        return results, time.perf_counter() - start
    finally:
        await client.close()


def _latencies(results: list, elapsed: float, tokens: int, what: str) -> str:
    """One line: the run's time and its percentiles of time to first token and per token."""
    first = sorted(r[2] for r in results)
    gaps = sorted(gap for r in results for gap in r[3])

    def pct(values: list[float]) -> str:
        at = (values[min(len(values) - 1, int(q * len(values)))] for q in (0.5, 0.9, 0.99))
        return "/".join(f"{1000 * value:.1f}" for value in at)

    return (
        f"\n[load] {len(results)} streams x {tokens} tokens in {elapsed:.2f} s ({what}); time to "
        f"first token ms p50/p90/p99 {pct(first)}; per-token ms p50/p90/p99 {pct(gaps)} (mean "
        f"{1000 * statistics.mean(gaps):.1f})"
    )


def test_load(
    url: str, fake: FakeEngine, model_dir: tuple, ids: Callable, capsys: pytest.CaptureFixture
) -> None:
    """64 concurrent streamed requests: none lost, each text whole; prints the latencies.

    The figures include the openai client's own work, in this process beside the server (one
    interpreter, shared cores): a bound on the server's, not its measure."""
    tokens = 32
    prompts = [f"request {i}: The quick" for i in range(64)]
    results, elapsed = asyncio.run(_stream_all(url, prompts, tokens))
    tokenizer = load_tokenizer(model_dir[0])
    for prompt, (text, reason, _, _) in zip(prompts, results, strict=True):
        echoed = ids(prompt)  # echoed in a cycle
        assert text == tokenizer.decode([echoed[j % len(echoed)] for j in range(tokens)])
        assert reason == "length"
    with capsys.disabled():
        print(_latencies(results, elapsed, tokens, f"fake engine, {1000 * fake.step_s:.0f} ms"))


def test_serve_command(model_dir: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pallas-flash-llama serve`` builds the engine from its flags, starts it, serves the app
    with uvicorn and stops the engine after (the engine faked, uvicorn.run served here)."""
    made: list[FakeEngine] = []

    class Engine(FakeEngine):
        def __init__(self, params: object, config: LlamaConfig, **options: object) -> None:
            super().__init__(options["page_size"] * options["pages_per_sequence"])
            self.options = options
            made.append(self)

    module = types.ModuleType("pallas_flash_llama.engine")
    module.Engine = Engine
    monkeypatch.setitem(sys.modules, "pallas_flash_llama.engine", module)
    served: list[dict] = []

    def run(app: object, host: str, port: int) -> None:
        assert (host, port) == ("127.0.0.1", 8123)
        with serving(app) as address:
            served.append(httpx.get(f"{address}/v1/models").json())

    monkeypatch.setattr(uvicorn, "run", run)
    argv = [
        "--compilation-cache",
        "off",
        "serve",
        "--model",
        str(model_dir[0]),
        "--port",
        "8123",
        "--slots",
        "2",
        "--served-model-name",
        "m",
        "--no-prefix-caching",
    ]
    assert cli.main(argv) == 0
    assert served[0]["data"][0]["id"] == "m"
    (engine,) = made
    assert engine.options == {
        "slots": 2,
        "token_budget": 256,
        "page_size": 16,
        "num_pages": 32,
        "pages_per_sequence": 16,
        "backend": None,
        "cache_dtype": None,
        "mesh": None,
        "prefix_caching": False,
    }
    assert engine._stop.is_set()  # stopped once uvicorn returned
    log = logging.getLogger("pallas_flash_llama.server")  # a line per request, on stderr
    assert log.level == logging.INFO and log.handlers


def test_real_engine_tiny_model(model_dir: tuple) -> None:
    """The same flow against the real engine (`pallas_flash_llama.engine`) on the tiny model."""
    from pallas_flash_llama.engine import Engine

    directory, _ = model_dir
    config, params = load_params(directory)
    engine = Engine(
        params,
        config,
        slots=4,
        token_budget=64,
        page_size=16,
        num_pages=64,
        pages_per_sequence=16,
        backend="xla",
    )
    engine.start()
    try:
        with serving(make_app(engine, directory, config, model_name=MODEL)) as address:
            client = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
            greedy = {
                "model": MODEL,
                "prompt": "The quick brown",
                "max_tokens": 8,
                "temperature": 0,
            }
            plain = client.completions.create(**greedy)
            assert plain.choices[0].finish_reason in ("length", "stop")
            assert 1 <= plain.usage.completion_tokens <= 8
            streamed = client.completions.create(**greedy, stream=True)
            assert "".join(chunk.choices[0].text for chunk in streamed) == plain.choices[0].text
            chat = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Once upon"}], max_tokens=8
            )
            assert chat.choices[0].finish_reason in ("length", "stop")
            with pytest.raises(openai.BadRequestError, match="maximum context length"):
                client.completions.create(model=MODEL, prompt=[5] * 300)

            async def many() -> list:
                batch = openai.AsyncOpenAI(base_url=f"{address}/v1", api_key="none")
                try:
                    return await asyncio.gather(
                        *(
                            batch.completions.create(
                                model=MODEL, prompt=f"{i} The quick", max_tokens=6, seed=i
                            )
                            for i in range(12)
                        )
                    )
                finally:
                    await batch.close()

            replies = asyncio.run(many())  # more requests than slots: queued, none lost
            assert all(1 <= reply.usage.completion_tokens <= 6 for reply in replies)
            shared = {**greedy, "prompt": "The quick brown fox jumps over the lazy dog. " * 4}
            first, again = (client.completions.create(**shared) for _ in range(2))
            assert first.usage.prompt_tokens > 32, "two full pages of 16 and more"
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            assert again.usage.prompt_tokens_details.cached_tokens == 32
            assert again.choices[0].text == first.choices[0].text
            assert _wait_for(lambda: engine.free_pages == engine.num_pages)
            cancelled, cancel = [], engine.cancel
            engine.cancel = lambda request_id: (cancelled.append(request_id), cancel(request_id))
            long = {"model": MODEL, "prompt": "Once", "max_tokens": 200, "stream": True}
            with httpx.stream("POST", f"{address}/v1/completions", json=long) as reply:
                first = json.loads(next(reply.iter_lines()).removeprefix("data: "))
            if first["choices"][0]["finish_reason"] is None:  # not ended by its first token
                assert _wait_for(lambda: cancelled == [first["id"]])  # the client left
            assert _wait_for(lambda: engine.free_pages == engine.num_pages)  # its pages freed
    finally:
        engine.stop()


def test_real_engine_load(model_dir: tuple, capsys: pytest.CaptureFixture) -> None:
    """64 concurrent streamed greedy requests on the real engine (tiny model, 8 slots): none
    lost, each stream's text the one its request gets served alone, every page free after;
    prints the latencies (CPU, the openai client in this process)."""
    from pallas_flash_llama.engine import Engine

    directory, _ = model_dir
    config, params = load_params(directory)
    engine = Engine(params, config, slots=8, token_budget=64, page_size=16, num_pages=64,
                    pages_per_sequence=8, backend="xla")  # fmt: skip
    tokens, prompts = 8, [f"{i}: The quick brown" for i in range(64)]
    engine.start()
    try:
        with serving(make_app(engine, directory, config, model_name=MODEL)) as address:
            alone = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
            greedy = {"model": MODEL, "max_tokens": tokens, "temperature": 0}
            expected = [
                alone.completions.create(prompt=prompt, **greedy).choices[0].text
                for prompt in prompts[:4]
            ]
            results, elapsed = asyncio.run(_stream_all(address, prompts, tokens))
    finally:
        engine.stop()
    assert [text for text, *_ in results[:4]] == expected
    assert all(reason in ("length", "stop") for _, reason, _, _ in results)
    assert engine.free_pages == engine.num_pages
    with capsys.disabled():
        print(_latencies(results, elapsed, tokens, "tiny model on the real engine, CPU"))
