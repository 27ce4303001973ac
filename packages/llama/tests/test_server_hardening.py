"""The server as users run it, beyond the API's answers (`server_limits`, `server_metrics`):
bodies over the size limit, prompts refused before they are tokenised, tokenising off the
event loop, ``/metrics`` by vLLM's names, vLLM's ``/tokenize``, ``/detokenize`` and
``/version``, a model's card, and one log line per request and per client gone. The engine is
`server_testing.FakeEngine`."""

from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import json
import logging
import pathlib
import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from llama_testing import HANG_S
from prometheus_client.parser import text_string_to_metric_families
from server_testing import JSON, MODEL, TEMPLATE, FakeEngine, serving

from pallas_flash_llama import server, tiny
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.server import make_app
from pallas_flash_llama.tokenizer import load_tokenizer

LIMIT = 4096
"""The small app's body limit, bytes."""


@pytest.fixture
def encodes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For each call of the server's tokenizer, whether it ran on an event loop's thread."""
    on_loop: list[bool] = []
    encode = server.encode

    def recorded(*args: object) -> list[int]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            on_loop.append(False)
        else:
            on_loop.append(True)
        return encode(*args)

    monkeypatch.setattr(server, "encode", recorded)
    return on_loop


def test_a_body_over_the_limit_gets_a_413_declared_or_streamed(
    model_dir: tuple[pathlib.Path, LlamaConfig], fake: FakeEngine
) -> None:
    small = make_app(fake, *model_dir, model_name=MODEL, max_request_bytes=LIMIT)
    body = json.dumps({"model": MODEL, "prompt": "x" * LIMIT}).encode()
    with serving(small) as address:
        declared = httpx.post(f"{address}/v1/completions", content=body, headers=JSON)
        # no Content-Length: the body comes in chunks, counted as they arrive
        chunks = (body[i : i + 1000] for i in range(0, len(body), 1000))
        streamed = httpx.post(f"{address}/v1/completions", content=chunks, headers=JSON)
        fits = httpx.post(f"{address}/v1/completions", headers=JSON,
                          content=json.dumps({"model": MODEL, "prompt": "The"}))  # fmt: skip
    for reply in (declared, streamed):
        assert reply.status_code == 413
        error = reply.json()["error"]
        assert error["message"] == f"Request body too large: the limit is {LIMIT} bytes"
        assert set(error) == {"message", "type", "param", "code"}
    assert "transfer-encoding" not in declared.request.headers
    assert streamed.request.headers["transfer-encoding"] == "chunked"
    assert fits.status_code == 200


def test_a_10_mb_prompt_is_refused_untokenised_while_health_answers(
    url: str, encodes: list[bool]
) -> None:
    """The prompt cannot fit in 256 tokens whatever its tokens: a 400 before any tokenising.
    Meanwhile ``/health`` keeps answering (it took 12.5 s when the prompt was tokenised on the
    event loop); the latencies are printed, the bound is far above them."""
    body = json.dumps({"model": MODEL, "prompt": "word " * 2_000_000})
    replies: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: replies.append(
            httpx.post(f"{url}/v1/completions", content=body, headers=JSON, timeout=HANG_S)
        )
    )
    latencies = []
    sender.start()
    while sender.is_alive():
        began = time.perf_counter()
        assert httpx.get(f"{url}/health", timeout=HANG_S).status_code == 200
        latencies.append(time.perf_counter() - began)
    sender.join()
    (reply,) = replies
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    assert "maximum context length is 256" in reply.json()["error"]["message"]
    assert encodes == []
    print(f"/health during a 10 MB request: {len(latencies)} calls, longest "
          f"{max(latencies) * 1e3:.1f} ms")  # fmt: skip
    assert max(latencies) < 2.0


def test_prompts_and_messages_are_tokenised_off_the_event_loop(
    client: openai.OpenAI, encodes: list[bool]
) -> None:
    client.completions.create(model=MODEL, prompt="The quick", max_tokens=1)
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert encodes == [False, False]  # in a worker thread, both


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_requests_by_vllm_s_names(url: str, client: openai.OpenAI) -> None:
    model = (("model_name", MODEL),)

    def value(found: dict, name: str, labels: tuple = model) -> float:
        return found.get((name, labels), 0.0)

    before = _metrics(url)
    one = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5)
    two = client.completions.create(model=MODEL, prompt="Once", max_tokens=3, n=2, stream=True)
    list(two)
    after = _metrics(url)

    def delta(name: str, labels: tuple = model) -> float:
        return value(after, name, labels) - value(before, name, labels)

    prompt = one.usage.prompt_tokens + 2  # "Once": bos and one token
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:prefix_cache_queries_total") == prompt
    assert delta("vllm:generation_tokens_total") == 5 + 2 * 3
    length = (("finished_reason", "length"), ("model_name", MODEL))
    assert delta("vllm:request_success_total", length) == 3  # one choice, then two
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 4 + 2 * 2  # gaps
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"):  # fmt: skip
        assert (gauge, model) in after
    content_type = httpx.get(f"{url}/metrics").headers["content-type"]
    assert content_type.startswith("text/plain; version=")


def test_tokenize_detokenize_tokenizer_info_version_and_the_model_s_card(
    url: str, model_dir: tuple[pathlib.Path, LlamaConfig]
) -> None:
    tokenizer = load_tokenizer(model_dir[0])
    words = tokenizer.encode("The quick brown").ids
    tokens = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "The quick brown"})
    assert tokens.json() == {"count": len(words) + 1, "max_model_len": 256,
                             "tokens": [1, *words], "token_strs": None}  # fmt: skip
    bare = httpx.post(f"{url}/tokenize", json={"prompt": "The quick brown",
                                                "add_special_tokens": False})  # fmt: skip
    assert bare.json()["tokens"] == words
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.json()["tokens"][0] == 1 and chat.json()["count"] > 3
    both = httpx.post(f"{url}/tokenize", json={"prompt": "a", "messages": []})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]

    text = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": [1, *words]})
    assert text.json() == {"prompt": "The quick brown"}  # bos skipped
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"

    info = httpx.get(f"{url}/tokenizer_info").json()  # lm-eval's remote tokenizer reads it
    assert (info["bos_token"], info["eos_token"], info["model_max_length"]) == ("<s>", "</s>", 256)
    assert info["chat_template"] == TEMPLATE

    version = httpx.get(f"{url}/version").json()
    assert version == {"version": importlib.metadata.version("pallas-flash-llama")}
    card = httpx.get(f"{url}/v1/models/{MODEL}").json()
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL, "model", 256)
    other = httpx.get(f"{url}/v1/models/gpt-4")
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


def test_the_readme_s_tiny_model_chats(tmp_path: pathlib.Path, fake: FakeEngine) -> None:
    """``init-tiny`` writes a chat template: chat clients (guidellm's default) can talk to
    the README's model."""
    config = tiny.init_tiny(tmp_path)
    with serving(make_app(fake, tmp_path, config, model_name="tiny")) as address:
        chat = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        reply = chat.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        tokens = httpx.post(f"{address}/tokenize", json={"messages": messages}).json()["tokens"]
    assert reply.choices[0].finish_reason in ("stop", "length")
    text = load_tokenizer(tmp_path).decode(tokens, skip_special_tokens=False)
    assert tokens[0] == 1 and text == "<s>system: Be brief.\nuser: hi\nassistant:"


def _wait_for(condition: Callable[[], object]) -> bool:
    deadline = time.monotonic() + HANG_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_one_log_line_per_request_and_per_client_gone(
    url: str, client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    reply = client.completions.create(model=MODEL, prompt="The quick", max_tokens=2)
    assert _wait_for(lambda: any(reply.id in r.getMessage() for r in caplog.records))
    (line,) = [r.getMessage() for r in caplog.records if reply.id in r.getMessage()]
    assert line == (f"{reply.id}: 3 prompt tokens (0 cached), 2 generated in 1 choice(s), "
                    f"first token {line.split('first token ')[1].split(',')[0]}, "
                    f"{line.split(', ')[-2]}, length")  # fmt: skip

    with pytest.raises(httpx.ReadTimeout):  # a plain request whose client leaves
        httpx.post(f"{url}/v1/completions", timeout=0.2,
                   json={"model": MODEL, "prompt": "Once", "max_tokens": 250})  # fmt: skip
    assert _wait_for(lambda: any("the client left" in r.getMessage() for r in caplog.records))
    gc.collect()  # an unretrieved future's traceback is logged when it is collected
    time.sleep(0.1)
    assert not [r for r in caplog.records if r.exc_info or "never retrieved" in r.getMessage()]
    gone = [r.getMessage() for r in caplog.records if "the client left" in r.getMessage()]
    assert len(gone) == 1 and gone[0].endswith("the client left before the answer; cancelled")
