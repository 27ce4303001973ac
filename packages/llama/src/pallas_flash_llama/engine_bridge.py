"""A request's choices in the engine, bridged into the event loop (the server's side of the
engine's thread).

The engine calls ``on_token`` and ``on_finish`` from its own thread; `Choice` hands each to
the event loop with ``loop.call_soon_threadsafe`` into its ``asyncio.Queue`` and turns them
into `Piece` s: text (`text_stream.TextStream`), a finish reason at the end, and the scored
tokens (`logprobs`) the text came with. `interleaved` merges a request's choices as they come.
A consumer that leaves early cancels the request in the engine, which frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple, Protocol

from pallas_flash_llama.logprobs import TokenLogprob
from pallas_flash_llama.scheduler import Finished, Request, SchedulerStats
from pallas_flash_llama.server_metrics import RequestTimes
from pallas_flash_llama.text_stream import TextStream


class Engine(Protocol):
    """What the server needs of `pallas_flash_llama.engine.Engine`."""

    @property
    def max_len(self) -> int: ...

    def submit(self, request: Request, on_token: Callable[[int, TokenLogprob | None], None],
               on_finish: Callable[[Finished], None]) -> None: ...  # fmt: skip

    def cancel(self, request_id: str) -> None: ...

    def stats(self) -> SchedulerStats: ...


class Piece(NamedTuple):
    """What a choice adds as it advances: ``text`` (may be empty), its finish ``reason`` on
    its last piece (else None), and the ``scored`` tokens since the last piece (with
    `Request.logprobs`; a stop token that is not text among them)."""

    text: str
    reason: str | None
    scored: list[TokenLogprob]


class Choice:
    """One choice of a request: a sequence in the engine, its callbacks bridged into an
    asyncio queue, its text (`TextStream`), times (`RequestTimes`) and scored tokens."""

    def __init__(self, engine: Engine, request: Request, text: TextStream) -> None:
        self.engine, self.request, self.text = engine, request, text
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, TokenLogprob | None] | Finished] = asyncio.Queue()
        self.times = RequestTimes()
        self.cached_tokens = 0  # prompt tokens the prefix cache held, once it ends
        self.reason: str | None = None  # why the engine ended it, once it has
        self.logprobs: list[TokenLogprob] = []  # with `Request.logprobs`, each token's
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # once it ends
        self.done = False
        engine.submit(request, self._token, self._post)

    @property
    def tokens(self) -> int:
        """Tokens the request has generated so far."""
        return self.times.tokens

    def _token(self, token: int, logprob: TokenLogprob | None) -> None:  # the engine's thread
        self._post((token, logprob))

    def _post(self, item: tuple[int, TokenLogprob | None] | Finished) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for the request
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def pieces(self) -> AsyncIterator[Piece]:
        """The choice's `Piece` s as it advances; the last has its finish reason. It ends
        when the engine has ended the request (a stop string cancels it there first).
        Leaving early (a client gone) cancels the request in the engine."""
        stopped, unsent = False, 0  # unsent: scored tokens not yet in a piece
        try:
            while not self.done:
                item = await self.queue.get()
                if isinstance(item, Finished):
                    self.done, self.cached_tokens = True, item.cached_tokens
                    self.reason = "stop" if stopped else item.reason
                    self.prompt_logprobs = item.prompt_logprobs
                    if not stopped:
                        yield Piece(self.text.flush(), item.reason, self.logprobs[unsent:])
                    continue
                if stopped:  # sampled before the engine took the cancel
                    continue
                token, logprob = item
                self.times.token()
                if logprob is not None:
                    self.logprobs.append(logprob)
                text, stopped = self.text.push(token)
                if stopped or text:
                    yield Piece(text, "stop" if stopped else None, self.logprobs[unsent:])
                    unsent = len(self.logprobs)
                if stopped:
                    self.engine.cancel(self.request.id)
        finally:
            if not self.done:
                self.engine.cancel(self.request.id)


async def interleaved(choices: list[Choice]) -> AsyncIterator[tuple[int, Piece]]:
    """``(choice index, piece)`` of every choice, as each comes. Leaving early cancels those
    not ended (`Choice.pieces`)."""
    merged: asyncio.Queue[tuple[int, Piece] | None] = asyncio.Queue()

    async def forward(index: int, choice: Choice) -> None:
        async for piece in choice.pieces():
            await merged.put((index, piece))
        await merged.put(None)

    tasks = [asyncio.ensure_future(forward(i, c)) for i, c in enumerate(choices)]
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
