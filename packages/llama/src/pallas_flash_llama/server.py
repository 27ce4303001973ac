"""An OpenAI-compatible HTTP server over the serving engine (``pallas-flash-llama serve``).

FastAPI served by uvicorn, the stack of vLLM's OpenAI server: pydantic validates the request
bodies into typed models (`openai_api`). Endpoints: ``POST /v1/completions``, ``POST
/v1/chat/completions`` (both plain or streamed as server-sent events: ``data: {chunk}``
lines, then ``data: [DONE]``), ``GET /v1/models`` and ``/v1/models/{id}``, and vLLM's ``POST
/tokenize`` and ``/detokenize``, ``GET /tokenizer_info``, ``/version``, ``/metrics`` (Prometheus,
`server_metrics`) and ``/health``.

- **Text** in and out as transformers would: a prompt is encoded with the directory's
  special tokens (`tokenizer.special_tokens`), messages through its chat template
  (`chat_template`), both in a worker thread so that a long text does not hold the event
  loop, after the checks that need no tokenizer (`server_limits`: the body's size, invalid
  Unicode, a text too long for any tokenisation to fit). Generated ids become text as they
  come (`text_stream.TextStream`).
- **Ends.** An eos id (``config.json``'s and ``tokenizer_config.json``'s; not with
  ``ignore_eos``), a ``stop_token_ids`` id or a stop string that is one token ends a request
  in the engine (its ``stop_ids``); other stop strings are found in the decoded text, which is
  cut before them, and the request is cancelled. Neither the stop token nor the stop string is
  in the text (OpenAI's behaviour) unless ``include_stop_str_in_output`` (vLLM's: the stop
  token decoded as the rest, special tokens skipped; the text cut after the stop string).
- **Threads.** The engine calls back from its own thread; `engine_bridge.Choice` hands each
  call to the event loop. A client that disconnects before its request ends gets it
  cancelled in the engine, which frees its pages, and one log line.
- **Logprobs** (`openai_logprobs`): completions' ``logprobs`` (with ``echo``, the prompt's
  tokens' first, the first unscored), chat's ``logprobs`` and ``top_logprobs``, vLLM's
  ``prompt_logprobs``: the engine scores the tokens (`logprobs`), a request that scores its
  prompt computing it whole.
- **Metrics.** Each request, once it ends, is counted and timed (`server_metrics`) and
  logged in one line.
- **Choices.** A request for ``n`` choices submits ``n`` sequences of the same prompt to the
  engine (choice ``i`` seeded ``seed + i``; choice 0 has the completion's id, choice ``i``
  the id with ``-i``); streamed, their chunks interleave as they come, each with its
  ``index``; the usage counts the prompt once and every choice's tokens, and the prompt
  tokens choice 0 found in the prefix cache (``prompt_tokens_details.cached_tokens``).
- **Errors** use OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` for every
  status: 400 for bad parameters, fields not served (`openai_api.refuse_unserved`), invalid
  Unicode and a prompt longer than the context; 404 for a model name other than the one
  served and for an unknown path; 405 for a method a path does not take; 413 for a body
  over the size limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import pathlib
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import fastapi
import fastapi.exceptions
import fastapi.responses
import prometheus_client
import starlette.exceptions

import pallas_flash as pf
from pallas_flash_llama.chat_template import SPECIAL_TOKEN_NAMES
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.engine_bridge import Choice, Engine, interleaved
from pallas_flash_llama.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    refuse_unserved,
)
from pallas_flash_llama.openai_logprobs import (
    Scored,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from pallas_flash_llama.sampling import Sampling
from pallas_flash_llama.scheduler import SEEDS, Request
from pallas_flash_llama.served_model import load_served_model
from pallas_flash_llama.server_limits import (
    MAX_REQUEST_BYTES,
    BodyLimit,
    surely_too_long,
    unicode_text,
)
from pallas_flash_llama.server_metrics import LOG, ServingMetrics
from pallas_flash_llama.text_stream import TextStream
from pallas_flash_llama.tokenizer import SpecialTokens, encode


async def _disconnected(request: fastapi.Request) -> None:
    """Returns once the client has closed the connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(chunk: dict[str, Any] | str) -> str:
    return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk, ensure_ascii=False)}\n\n"


def _validation_error(error: fastapi.exceptions.RequestValidationError) -> ApiError:
    first = error.errors()[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return ApiError(400, f"We could not parse the JSON body of your request: {reason}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    prefix = f"{'.'.join(loc)}: " if loc and not message.startswith(f"{loc[0]}:") else ""
    # a check across fields names its field first: "prompt_logprobs: ..."
    named = message.split(":", 1)[0] if ":" in message else ""
    param = loc[0] if loc else named if named.isidentifier() else None
    return ApiError(400, prefix + message, param=param)


def make_app(engine: Engine, directory: str | pathlib.Path, config: LlamaConfig,
             model_name: str | None = None,
             max_request_bytes: int = MAX_REQUEST_BYTES) -> fastapi.FastAPI:  # fmt: skip
    """The OpenAI-compatible app (module doc) serving ``engine``'s model, whose tokenizer and
    chat template are in ``directory``, as ``model_name`` (default: the directory's path);
    request bodies over ``max_request_bytes`` get a 413."""
    model = load_served_model(directory, config, model_name)
    metrics = ServingMetrics(model.name, engine.stats)
    app = fastapi.FastAPI(title="pallas-flash-llama", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=max_request_bytes)

    @app.exception_handler(ApiError)
    async def _api_error(_: fastapi.Request, error: ApiError) -> fastapi.responses.JSONResponse:
        return fastapi.responses.JSONResponse(error_body(error), status_code=error.status)

    @app.exception_handler(fastapi.exceptions.RequestValidationError)
    async def _invalid(_: fastapi.Request, error: Exception) -> fastapi.responses.JSONResponse:
        return await _api_error(_, _validation_error(error))

    @app.exception_handler(starlette.exceptions.HTTPException)
    async def _http(request: fastapi.Request, error: Exception) -> fastapi.responses.JSONResponse:
        status = getattr(error, "status_code", 500)
        where = f"{request.method} {request.url.path}"
        message = {404: f"Invalid URL ({where})", 405: f"Method not allowed ({where})"}
        detail = str(getattr(error, "detail", error))
        return await _api_error(request, ApiError(status, message.get(status, detail)))

    @app.exception_handler(pf.InvalidInputError)
    async def _input(_: fastapi.Request, error: Exception) -> fastapi.responses.JSONResponse:
        return await _api_error(_, ApiError(400, str(error)))

    def served(name: str | None) -> None:
        """Raises the 404 of a model name other than the served model's."""
        if name is not None and name != model.name:
            raise ApiError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    def start(body: CompletionRequest | ChatCompletionRequest, prompt: list[int],
              max_tokens: int | None, prefix: str, field: str) -> list[Choice]:  # fmt: skip
        """Checks the request against the context, and submits its ``n`` choices."""
        if any(not 0 <= token < model.vocab for token in prompt):
            raise ApiError(400, f"{field}: token ids must be in [0, {model.vocab})", field)
        room = engine.max_len - len(prompt)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise ApiError(
                400,
                f"This model's maximum context length is {engine.max_len} tokens. However, you "
                f"requested {len(prompt) + (max_tokens or 1)} tokens ({len(prompt)} in the "
                f"{field}, {max_tokens or 1} in the completion). Please reduce the length of "
                f"the {field} or completion.",
                field if room < 1 else "max_tokens",
            )
        refuse_unserved(body)
        if max_tokens is not None and body.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens: expected at most max_tokens ({max_tokens}), got "
                           f"{body.min_tokens}", "min_tokens")  # fmt: skip
        biased = [int(token) for token in body.logit_bias or ()]
        if any(token >= model.vocab for token in biased):
            raise ApiError(400, f"logit_bias: token ids must be in [0, {model.vocab})",
                           "logit_bias")  # fmt: skip
        stop_ids = set() if body.ignore_eos else set(model.eos_ids)
        for token in body.stop_token_ids or ():
            if not 0 <= token < model.vocab:
                raise ApiError(400, f"stop_token_ids: token ids must be in [0, {model.vocab})",
                               "stop_token_ids")  # fmt: skip
            stop_ids.add(token)
        for stop in body.stop_strings:  # a stop string of one token stops in the engine
            ids = model.tokenizer.encode(unicode_text(stop, "stop"), add_special_tokens=False).ids
            if len(ids) == 1 and model.tokenizer.decode(ids) == stop:
                stop_ids.add(ids[0])
        top_k = None if body.top_k is None or body.top_k < 1 else body.top_k
        first = f"{prefix}-{uuid.uuid4().hex}"
        seed = secrets.randbits(31) if body.seed is None else body.seed
        choices = []
        for i in range(body.n):
            request = Request(
                id=first if i == 0 else f"{first}-{i}",
                prompt=tuple(prompt),
                max_tokens=room if max_tokens is None else max_tokens,
                stop_ids=tuple(sorted(stop_ids)),
                sampling=Sampling(body.temperature, top_k, body.top_p),
                seed=(seed + i) % SEEDS,
                logprobs=body.logprob_count,
                prompt_logprobs=body.prompt_logprob_count,
                processing=body.processing,
            )
            text = TextStream(model.tokenizer, body.stop_strings, stop_ids,
                              body.include_stop_str_in_output, body.min_tokens)  # fmt: skip
            choices.append(Choice(engine, request, text))
        return choices

    async def answer(request: fastapi.Request, choices: list[Choice],
                     body: CompletionRequest | ChatCompletionRequest, chat: bool,
                     echo: str = "") -> fastapi.responses.Response | dict[str, Any]:  # fmt: skip
        """The response: streamed chunks, or the whole texts once every choice ends, each
        completion's led by ``echo`` (the prompt's text, with ``echo``); either way the
        request is counted in the metrics and logged once it ends."""
        first = choices[0].request
        head = {"id": first.id, "created": int(time.time()), "model": model.name}
        count = body.logprob_count

        def ended() -> None:
            metrics.finished(first.id, len(first.prompt), choices[0].cached_tokens,
                             [c.times for c in choices], [c.reason for c in choices])  # fmt: skip

        def usage() -> dict[str, Any]:
            prompt, completion = len(first.prompt), sum(c.tokens for c in choices)
            cached = {"cached_tokens": choices[0].cached_tokens}
            return {"prompt_tokens": prompt, "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                    "prompt_tokens_details": cached}  # fmt: skip

        def scored_logprobs(scored: list[Scored], offset: int) -> dict[str, Any] | None:
            if count is None:
                return None
            if chat:
                return chat_logprobs(model.tokenizer, [lp for _, lp in scored if lp])
            return completion_logprobs(model.tokenizer, scored, count, offset)

        def entry(index: int, text: str, reason: str | None, logprobs: dict[str, Any] | None,
                  delta: dict[str, str] | None = None) -> dict:  # fmt: skip
            if chat:
                return {"index": index, "delta": {"content": text} if delta is None else delta,
                        "logprobs": logprobs, "finish_reason": reason}  # fmt: skip
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

        if body.stream:
            kind = "chat.completion.chunk" if chat else "text_completion"

            def chunk(index: int, *choice: Any) -> str:
                return _sse({**head, "object": kind, "choices": [entry(index, *choice)]})

            async def events() -> AsyncIterator[str]:
                offsets = [len(echo)] * len(choices)  # of the next token's text, a choice's
                try:
                    for i in range(len(choices)):
                        if chat:
                            yield chunk(i, "", None, None, {"role": "assistant", "content": ""})
                        elif echo:
                            yield chunk(i, echo, None, None)
                    async for i, piece in interleaved(choices):
                        scored = [(lp.token, lp) for lp in piece.scored]
                        logprobs = scored_logprobs(scored, offsets[i])
                        if logprobs is not None and not chat:
                            offsets[i] += sum(map(len, logprobs["tokens"]))
                        yield chunk(i, piece.text, piece.reason, logprobs)
                    if body.stream_options and body.stream_options.include_usage:
                        yield _sse({**head, "object": kind, "choices": [], "usage": usage()})
                    yield _sse("[DONE]")
                finally:
                    ended()

            return fastapi.responses.StreamingResponse(events(), media_type="text/event-stream")

        async def collect(choice: Choice) -> tuple[str, str | None]:
            pieces = [piece async for piece in choice.pieces()]
            return "".join(piece.text for piece in pieces), pieces[-1].reason if pieces else None

        whole = asyncio.ensure_future(asyncio.gather(*map(collect, choices)))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait((whole, gone), return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not whole.done():  # the client left: cancelling `whole` cancels the requests
            whole.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await whole
            LOG.info("%s: the client left before the answer; cancelled", first.id)
            ended()
            return fastapi.responses.Response(status_code=499)
        texts = whole.result()
        ended()
        results = []
        for i, (choice, (text, reason)) in enumerate(zip(choices, texts, strict=True)):
            scored: list[Scored] = [(lp.token, lp) for lp in choice.logprobs]
            if echo and count is not None:  # the prompt's tokens first, the first unscored
                scored = [*zip(first.prompt, choice.prompt_logprobs, strict=True), *scored]
            logprobs = scored_logprobs(scored, 0)
            if chat:
                results.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": reason})  # fmt: skip
                continue
            results.append(entry(i, echo + text, reason, logprobs))
            if body.prompt_logprobs is not None:
                results[-1]["prompt_logprobs"] = prompt_logprobs(
                    model.tokenizer, choice.prompt_logprobs, body.prompt_logprobs
                )  # fmt: skip
        answered = {**head, "object": "chat.completion" if chat else "text_completion",
                    "choices": results, "usage": usage()}  # fmt: skip
        if chat and body.prompt_logprobs is not None:  # vLLM's: the response's, for chat
            answered["prompt_logprobs"] = prompt_logprobs(
                model.tokenizer, choices[0].prompt_logprobs, body.prompt_logprobs
            )  # fmt: skip
        return answered

    async def tokens_of(text: str, field: str, special: SpecialTokens) -> list[int]:
        """``text`` tokenised off the event loop (a long text takes a while), after the
        checks that need no tokenizer (`server_limits`)."""
        unicode_text(text, field)
        if surely_too_long(text, engine.max_len, model.token_bytes):
            raise ApiError(400, f"This model's maximum context length is {engine.max_len} "
                           f"tokens. However, your {field} is {len(text)} characters long, "
                           f"more than {engine.max_len} tokens whatever its text. Please "
                           f"reduce the length of the {field}.", field)  # fmt: skip
        return await asyncio.to_thread(encode, model.tokenizer, text, special)

    async def chat_prompt(messages: list[Any]) -> list[int]:
        """The messages through the chat template, tokenised (the template wrote the
        special tokens), off the event loop."""
        if model.chat_template is None:
            raise ApiError(400, f"The model `{model.name}` has no chat template (no "
                           "chat_template in its tokenizer_config.json): use /v1/completions",
                           "messages")  # fmt: skip
        for_template = [message.for_template() for message in messages]
        text = await asyncio.to_thread(model.chat_template.render, for_template)
        return await tokens_of(text, "messages", SpecialTokens())

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: fastapi.Request) -> Any:
        served(body.model)
        if isinstance(body.prompt, str):
            prompt = await tokens_of(body.prompt, "prompt", model.special)
        else:
            prompt = list(body.prompt)
        choices = start(body, prompt, body.max_tokens, "cmpl", "prompt")
        if not body.echo:
            return await answer(request, choices, body, chat=False)
        echo = body.prompt if isinstance(body.prompt, str) else model.tokenizer.decode(prompt)
        return await answer(request, choices, body, chat=False, echo=echo)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: fastapi.Request) -> Any:
        served(body.model)
        prompt = await chat_prompt(body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        choices = start(body, prompt, max_tokens, "chatcmpl", "messages")
        return await answer(request, choices, body, chat=True)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's ``/tokenize``: a prompt's token ids (with the model's special tokens unless
        ``add_special_tokens`` is false) or messages' through the chat template."""
        served(body.model)
        if body.messages is not None:
            tokens = await chat_prompt(body.messages)
        else:
            special = model.special if body.add_special_tokens else SpecialTokens()
            tokens = await tokens_of(body.prompt, "prompt", special)
        return {"count": len(tokens), "max_model_len": engine.max_len, "tokens": tokens,
                "token_strs": None}  # fmt: skip

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's ``/tokenizer_info``: the special tokens, chat template and context length
        a client needs to tokenise as the server does (lm-evaluation-harness's ``remote``
        tokenizer reads it, then calls ``/tokenize`` and ``/detokenize``)."""
        template = model.chat_template
        return {**{name: model.special_strings.get(name) for name in SPECIAL_TOKEN_NAMES},
                "chat_template": None if template is None else template.source,
                "model_max_length": engine.max_len,
                "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        """vLLM's ``/detokenize``: token ids as text (special tokens skipped)."""
        served(body.model)
        if any(not 0 <= token < model.vocab for token in body.tokens):
            raise ApiError(400, f"tokens: token ids must be in [0, {model.vocab})", "tokens")
        return {"prompt": model.tokenizer.decode(body.tokens)}

    def card() -> dict[str, Any]:
        return {"id": model.name, "object": "model", "created": model.created,
                "owned_by": "pallas-flash", "max_model_len": engine.max_len}  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{name:path}")
    async def model_card(name: str) -> dict[str, Any]:
        served(name)
        return card()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("pallas-flash-llama")}

    @app.get("/metrics")
    async def prometheus_metrics() -> fastapi.responses.Response:
        text_format = prometheus_client.CONTENT_TYPE_LATEST
        return fastapi.responses.Response(metrics.exposition(), media_type=text_format)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
