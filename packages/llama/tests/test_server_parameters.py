"""Every request parameter of OpenAI's and vLLM's completions APIs, row by row: served, it
reaches the engine's request as its definition needs (the definitions themselves are held
against their references in `test_logit_processing` (vLLM's sampler, in NumPy),
`test_server_logprobs` and `test_engine` (float64 log-softmax) and `test_server` (stops));
not served, it is refused with a 400 naming it unless it holds a value that asks nothing."""

from __future__ import annotations

import httpx
import pytest
from server_testing import MODEL

from pallas_flash_llama.logit_processing import LogitProcessing
from pallas_flash_llama.openai_api import BOOKKEEPING, NO_OP_VALUES
from pallas_flash_llama.sampling import Sampling

COMPLETION = {"model": MODEL, "prompt": "The quick", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

SERVED = [
    ("temperature", 0.5, lambda r: r.sampling == Sampling(0.5)),
    ("top_p", 0.9, lambda r: r.sampling.top_p == 0.9),
    ("top_k", 7, lambda r: r.sampling.top_k == 7),
    ("seed", 11, lambda r: r.seed == 11),
    ("max_tokens", 3, lambda r: r.max_tokens == 3),
    ("stop_token_ids", [9], lambda r: 9 in r.stop_ids),
    ("ignore_eos", True, lambda r: 2 not in r.stop_ids),
    ("logprobs", 3, lambda r: r.logprobs == 3),
    ("prompt_logprobs", 2, lambda r: r.prompt_logprobs == 2),
    ("logit_bias", {"5": -3.0}, lambda r: r.processing == LogitProcessing(((5, -3.0),))),
    ("presence_penalty", 0.5, lambda r: r.processing == LogitProcessing(presence_penalty=0.5)),
    ("frequency_penalty", 0.5, lambda r: r.processing == LogitProcessing(frequency_penalty=0.5)),
    ("repetition_penalty", 1.2, lambda r: r.processing == LogitProcessing(repetition_penalty=1.2)),
    ("min_p", 0.1, lambda r: r.processing == LogitProcessing(min_p=0.1)),
    ("min_tokens", 2, lambda r: r.processing == LogitProcessing(min_tokens=2)),
]
"""Served parameters of /v1/completions: a value and what the engine's request then holds
(``n``, ``stream``, ``stop``, ``echo`` and ``include_stop_str_in_output`` shape the answer:
their tests are `test_server`'s and `test_server_logprobs`')."""


@pytest.mark.parametrize(("name", "value", "holds"), SERVED, ids=[row[0] for row in SERVED])
def test_a_served_parameter_reaches_the_engine(url, fake, name, value, holds) -> None:
    reply = httpx.post(f"{url}/v1/completions", json={**COMPLETION, name: value}, timeout=60)
    assert reply.status_code == 200, reply.text
    request = next(r for r in fake.submitted if r.id == reply.json()["id"])
    assert holds(request), request


@pytest.mark.parametrize("name", sorted(NO_OP_VALUES))
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_parameter_not_served_is_refused_by_name_unless_it_asks_nothing(
    url: str, endpoint: str, name: str
) -> None:
    body = COMPLETION if endpoint == "completions" else CHAT
    if endpoint == "completions" and name == "echo":
        pytest.skip("completions serve echo")
    refused = httpx.post(f"{url}/v1/{endpoint}", json={**body, name: "something"})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == name
    assert refused.json()["error"]["message"] == f"{name}: not supported by this server"
    for nothing in (None, *NO_OP_VALUES[name]):
        reply = httpx.post(f"{url}/v1/{endpoint}", json={**body, name: nothing})
        assert reply.status_code == 200, (nothing, reply.text)


@pytest.mark.parametrize("name", sorted(BOOKKEEPING))
def test_bookkeeping_fields_are_accepted_and_unknown_ones_refused(url: str, name: str) -> None:
    assert httpx.post(f"{url}/v1/completions", json={**COMPLETION, name: "x"}).status_code == 200
    unknown = httpx.post(f"{url}/v1/completions", json={**COMPLETION, f"{name}_typo": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == f"{name}_typo"
