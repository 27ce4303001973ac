"""An OpenAI-compatible HTTP server over the serving engine (``pallas-flash-llama serve``).

FastAPI served by uvicorn, the stack of vLLM's OpenAI server: pydantic validates the request
bodies into typed models (`openai_api`). Endpoints: ``POST /v1/completions``, ``POST
/v1/chat/completions`` (both plain or streamed as server-sent events: ``data: {chunk}``
lines, then ``data: [DONE]``), ``GET /v1/models`` and ``GET /health``.

- **Text** in and out as transformers would: a prompt is encoded with the directory's
  special tokens (`tokenizer.special_tokens`), messages through its chat template
  (`chat_template`). Generated ids are decoded whole after each token and the new suffix is
  sent (`TextStream`), holding back a trailing incomplete UTF-8 character (``\\ufffd``) and
  any tail that may begin a stop string.
- **Ends.** An eos id (``config.json``'s and ``tokenizer_config.json``'s; not with
  ``ignore_eos``), a ``stop_token_ids`` id or a stop string that is one token ends a request
  in the engine (its ``stop_ids``); other stop strings are found in the decoded text, which is
  cut before them, and the request is cancelled. Neither the stop token nor the stop string is
  in the text (OpenAI's behaviour) unless ``include_stop_str_in_output`` (vLLM's: the stop
  token decoded as the rest, special tokens skipped; the text cut after the stop string).
- **Threads.** The engine calls ``on_token`` and ``on_finish`` from its own thread; each is
  handed to the event loop with ``loop.call_soon_threadsafe`` into the request's
  ``asyncio.Queue``. A client that disconnects before its request ends gets it cancelled in
  the engine (``engine.cancel``), which frees its pages.
- **Choices.** A request for ``n`` choices submits ``n`` sequences of the same prompt to the
  engine (choice ``i`` seeded ``seed + i``; choice 0 has the completion's id, choice ``i``
  the id with ``-i``); streamed, their chunks interleave as they come, each with its
  ``index``; the usage counts the prompt once and every choice's tokens, and the prompt
  tokens choice 0 found in the prefix cache (``prompt_tokens_details.cached_tokens``).
- **Errors** use OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` for every
  status: 400 for bad parameters, fields not served (`openai_api.refuse_unserved`), invalid
  Unicode and a prompt longer than the context; 404 for a model name other than the one
  served and for an unknown path; 405 for a method a path does not take.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import pathlib
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any, Protocol

import fastapi
import fastapi.exceptions
import fastapi.responses
import starlette.exceptions
from tokenizers import Tokenizer

import pallas_flash as pf
from pallas_flash_llama.chat_template import (
    ChatTemplate,
    load_chat_template,
    special_token_strings,
)
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    refuse_unserved,
)
from pallas_flash_llama.sampling import Sampling
from pallas_flash_llama.scheduler import SEEDS, Finished, Request
from pallas_flash_llama.tokenizer import SpecialTokens, encode, load_tokenizer, special_tokens

HOLD = "\ufffd"
"""What a decoder gives for the bytes of a character whose last bytes are yet to come."""


class Engine(Protocol):
    """What the server needs of `pallas_flash_llama.engine.Engine`."""

    @property
    def max_len(self) -> int: ...

    def submit(self, request: Request, on_token: Callable[[int], None],
               on_finish: Callable[[Finished], None]) -> None: ...  # fmt: skip

    def cancel(self, request_id: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """The served model as the API sees it: its name, tokenizer, eos ids, chat template."""

    name: str
    tokenizer: Tokenizer
    special: SpecialTokens
    eos_ids: frozenset[int]
    vocab: int
    chat_template: ChatTemplate | None
    created: int


def load_served_model(directory: str | pathlib.Path, config: LlamaConfig,
                      name: str | None = None) -> ServedModel:  # fmt: skip
    """The tokenizer side of a model directory; ``name`` defaults to the directory's path."""
    tokenizer = load_tokenizer(directory)
    eos_token = special_token_strings(directory).get("eos_token")
    eos_ids = set(config.eos_ids)
    if eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
        eos_ids.add(tokenizer.token_to_id(eos_token))
    return ServedModel(
        name=name or str(directory),
        tokenizer=tokenizer,
        special=special_tokens(directory, tokenizer, config),
        eos_ids=frozenset(eos_ids),
        vocab=config.vocab,
        chat_template=load_chat_template(directory),
        created=int(time.time()),
    )


class TextStream:
    """A request's generated ids as text, sent a piece at a time (module doc)."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], stop_ids: Collection[int],
                 include_stop: bool = False) -> None:  # fmt: skip
        self.tokenizer, self.stop, self.stop_ids = tokenizer, stop, frozenset(stop_ids)
        self.include_stop = include_stop
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` sent

    def push(self, token: int) -> tuple[str, bool]:
        """The text ``token`` adds that can be sent now, and whether a stop string ended it."""
        if token in self.stop_ids and not self.include_stop:  # ends it in the engine; not text
            return "", False
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        kept = len if self.include_stop else lambda stop: 0  # of a stop string found
        found = [self.text.find(stop) + kept(stop) for stop in self.stop if stop in self.text]
        if found:
            self.text = self.text[: min(found)]
            return self.flush(), True
        body = self.text.rstrip(HOLD)
        held = max((k for stop in self.stop for k in range(1, len(stop))
                    if body.endswith(stop[:k])), default=0)  # fmt: skip
        end = max(self.sent, len(body) - held)
        piece, self.sent = self.text[self.sent : end], end
        return piece, False

    def flush(self) -> str:
        """The text not yet sent (the request has ended)."""
        piece, self.sent = self.text[self.sent :], len(self.text)
        return piece


class _Generation:
    """One request in the engine, its callbacks bridged into an asyncio queue."""

    def __init__(self, engine: Engine, request: Request, text: TextStream) -> None:
        self.engine, self.request, self.text = engine, request, text
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[int | Finished] = asyncio.Queue()
        self.tokens = 0
        self.cached_tokens = 0  # prompt tokens the prefix cache held, once it ends
        self.done = False
        engine.submit(request, self._post, self._post)

    def _post(self, item: int | Finished) -> None:  # the engine's thread
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for the request
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def pieces(self) -> AsyncIterator[tuple[str, str | None]]:
        """(text, finish reason or None) as the request advances; the last has its reason.
        It ends when the engine has ended the request (a stop string cancels it there first).
        Leaving early (a client gone) cancels the request in the engine."""
        stopped = False
        try:
            while not self.done:
                item = await self.queue.get()
                if isinstance(item, Finished):
                    self.done, self.cached_tokens = True, item.cached_tokens
                    if not stopped:
                        yield self.text.flush(), item.reason
                    continue
                if stopped:  # sampled before the engine took the cancel
                    continue
                self.tokens += 1
                piece, stopped = self.text.push(item)
                if stopped:
                    self.engine.cancel(self.request.id)
                    yield piece, "stop"
                elif piece:
                    yield piece, None
        finally:
            if not self.done:
                self.engine.cancel(self.request.id)


async def _interleaved(
    generations: list[_Generation],
) -> AsyncIterator[tuple[int, str, str | None]]:
    """``(choice index, text, finish reason or None)`` of every generation, as each comes.
    Leaving early cancels those not ended (`_Generation.pieces`)."""
    merged: asyncio.Queue[tuple[int, str, str | None] | None] = asyncio.Queue()

    async def forward(index: int, generation: _Generation) -> None:
        async for piece, reason in generation.pieces():
            await merged.put((index, piece, reason))
        await merged.put(None)

    tasks = [asyncio.ensure_future(forward(i, g)) for i, g in enumerate(generations)]
    try:
        ended = 0
        while ended < len(tasks):
            item = await merged.get()
            if item is None:
                ended += 1
            else:
                yield item
        await asyncio.gather(*tasks)  # a failure in one is the response's
    finally:
        for task in tasks:
            task.cancel()


async def _disconnected(request: fastapi.Request) -> None:
    """Returns once the client has closed the connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(chunk: dict[str, Any] | str) -> str:
    return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk, ensure_ascii=False)}\n\n"


def _unicode(text: str, field: str) -> str:
    """``text``, or a 400 naming ``field`` where it holds a lone UTF-16 surrogate (which no
    tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        where = f"{text[error.start]!r} at character {error.start}"
        raise ApiError(400, f"{field}: invalid Unicode: a lone surrogate {where}", field) from None
    return text


def _validation_error(error: fastapi.exceptions.RequestValidationError) -> ApiError:
    first = error.errors()[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return ApiError(400, f"We could not parse the JSON body of your request: {reason}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    prefix = f"{'.'.join(loc)}: " if loc and not message.startswith(f"{loc[0]}:") else ""
    return ApiError(400, prefix + message, param=loc[0] if loc else None)


def make_app(engine: Engine, directory: str | pathlib.Path, config: LlamaConfig,
             model_name: str | None = None) -> fastapi.FastAPI:  # fmt: skip
    """The OpenAI-compatible app (module doc) serving ``engine``'s model, whose tokenizer and
    chat template are in ``directory``, as ``model_name`` (default: the directory's path)."""
    model = load_served_model(directory, config, model_name)
    app = fastapi.FastAPI(title="pallas-flash-llama", docs_url=None, redoc_url=None)

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
              max_tokens: int | None, prefix: str, field: str) -> list[_Generation]:  # fmt: skip
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
        stop_ids = set() if body.ignore_eos else set(model.eos_ids)
        for token in body.stop_token_ids or ():
            if not 0 <= token < model.vocab:
                raise ApiError(400, f"stop_token_ids: token ids must be in [0, {model.vocab})",
                               "stop_token_ids")  # fmt: skip
            stop_ids.add(token)
        for stop in body.stop_strings:  # a stop string of one token stops in the engine
            ids = model.tokenizer.encode(_unicode(stop, "stop"), add_special_tokens=False).ids
            if len(ids) == 1 and model.tokenizer.decode(ids) == stop:
                stop_ids.add(ids[0])
        top_k = None if body.top_k is None or body.top_k < 1 else body.top_k
        first = f"{prefix}-{uuid.uuid4().hex}"
        seed = secrets.randbits(31) if body.seed is None else body.seed
        generations = []
        for i in range(body.n):
            request = Request(
                id=first if i == 0 else f"{first}-{i}",
                prompt=tuple(prompt),
                max_tokens=room if max_tokens is None else max_tokens,
                stop_ids=tuple(sorted(stop_ids)),
                sampling=Sampling(body.temperature, top_k, body.top_p),
                seed=(seed + i) % SEEDS,
            )
            text = TextStream(model.tokenizer, body.stop_strings, stop_ids,
                              body.include_stop_str_in_output)  # fmt: skip
            generations.append(_Generation(engine, request, text))
        return generations

    async def answer(request: fastapi.Request, generations: list[_Generation],
                     body: CompletionRequest | ChatCompletionRequest, chat: bool,
                     ) -> fastapi.responses.Response | dict[str, Any]:  # fmt: skip
        """The response: streamed chunks, or the whole texts once every choice ends."""
        first = generations[0].request
        head = {"id": first.id, "created": int(time.time()), "model": model.name}

        def usage() -> dict[str, Any]:
            prompt, completion = len(first.prompt), sum(g.tokens for g in generations)
            cached = {"cached_tokens": generations[0].cached_tokens}
            return {"prompt_tokens": prompt, "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                    "prompt_tokens_details": cached}  # fmt: skip

        def choice(index: int, piece: str, reason: str | None,
                   delta: dict[str, str] | None = None) -> dict:  # fmt: skip
            if chat:
                return {"index": index, "delta": {"content": piece} if delta is None else delta,
                        "logprobs": None, "finish_reason": reason}  # fmt: skip
            return {"index": index, "text": piece, "logprobs": None, "finish_reason": reason}

        if body.stream:
            kind = "chat.completion.chunk" if chat else "text_completion"

            async def events() -> AsyncIterator[str]:
                if chat:
                    opening = {"role": "assistant", "content": ""}
                    for i in range(len(generations)):
                        yield _sse({**head, "object": kind,
                                    "choices": [choice(i, "", None, opening)]})  # fmt: skip
                async for i, piece, reason in _interleaved(generations):
                    yield _sse({**head, "object": kind, "choices": [choice(i, piece, reason)]})
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse({**head, "object": kind, "choices": [], "usage": usage()})
                yield _sse("[DONE]")

            return fastapi.responses.StreamingResponse(events(), media_type="text/event-stream")

        async def collect(generation: _Generation) -> tuple[str, str | None]:
            pieces, last = [], None
            async for piece, reason in generation.pieces():
                pieces.append(piece)
                last = reason
            return "".join(pieces), last

        whole = asyncio.ensure_future(asyncio.gather(*map(collect, generations)))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait((whole, gone), return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not whole.done():  # the client left: cancelling `whole` cancels the requests
            whole.cancel()
            return fastapi.responses.Response(status_code=499)
        ended = whole.result()
        if chat:
            results = [{"index": i, "message": {"role": "assistant", "content": text},
                        "logprobs": None, "finish_reason": reason}
                       for i, (text, reason) in enumerate(ended)]  # fmt: skip
            return {**head, "object": "chat.completion", "choices": results, "usage": usage()}
        return {**head, "object": "text_completion",
                "choices": [choice(i, text, reason) for i, (text, reason) in enumerate(ended)],
                "usage": usage()}  # fmt: skip

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: fastapi.Request) -> Any:
        served(body.model)
        if isinstance(body.prompt, str):
            prompt = encode(model.tokenizer, _unicode(body.prompt, "prompt"), model.special)
        else:
            prompt = list(body.prompt)
        generations = start(body, prompt, body.max_tokens, "cmpl", "prompt")
        return await answer(request, generations, body, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: fastapi.Request) -> Any:
        served(body.model)
        if model.chat_template is None:
            raise ApiError(400, f"The model `{model.name}` has no chat template (no "
                           "chat_template in its tokenizer_config.json): use /v1/completions",
                           "messages")  # fmt: skip
        text = model.chat_template.render([message.for_template() for message in body.messages])
        # the template wrote the special tokens
        prompt = encode(model.tokenizer, _unicode(text, "messages"), SpecialTokens())
        max_tokens = body.max_completion_tokens or body.max_tokens
        generations = start(body, prompt, max_tokens, "chatcmpl", "messages")
        return await answer(request, generations, body, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model.name, "object": "model", "created": model.created,
                "owned_by": "pallas-flash", "max_model_len": engine.max_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
