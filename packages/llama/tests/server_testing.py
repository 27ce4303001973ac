"""Helpers of the server tests: `FakeEngine`, the engine's interface without a model;
`serving`, an app on a free port; and `chat_model`, the tiny model with a chat template."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn
from llama_testing import HANG_S

import pallas_flash as pf
from pallas_flash_llama import tiny
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.logprobs import TokenLogprob
from pallas_flash_llama.scheduler import Finished, Request, SchedulerStats
from pallas_flash_llama.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE

MODEL = "tiny-chat"
JSON = {"content-type": "application/json"}
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'tool' %}{{ raise_exception('no tool messages here') }}{% endif %}"
    "{{ m.role }}: {{ m.content }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def fake_logprob(token: int, count: int) -> TokenLogprob:
    """`FakeEngine`'s score of ``token``: ``-token / 100``, rank 2, and ``count`` alternatives
    ``token + 1`` on at ``-(token + 1) / 1000`` on (more likely than it)."""
    top = tuple((token + 1 + j, -(token + 1 + j) / 1000) for j in range(count))
    return TokenLogprob(token, -token / 100, 2, top)


def fake_prompt_logprobs(request: Request) -> tuple[TokenLogprob | None, ...]:
    """`FakeEngine`'s scores of a prompt's tokens (`fake_logprob`), with ``prompt_logprobs``."""
    count = request.prompt_logprobs
    if count is None:
        return ()
    return (None, *(fake_logprob(token, count) for token in request.prompt[1:]))


@dataclasses.dataclass
class _Running:
    request: Request
    on_token: Callable[[int, TokenLogprob | None], None]
    on_finish: Callable[[Finished], None]
    tokens: list[int] = dataclasses.field(default_factory=list)


class FakeEngine:
    """The engine's interface, deterministic: every ``step_s`` its thread gives each running
    request its next token, the prompt's ids again in a cycle (scored by `fake_logprob`
    where asked); stop ids and ``max_tokens`` end a request as the real engine does, `cancel`
    ends it as ``cancelled``."""

    def __init__(self, max_len: int, step_s: float = 0.003) -> None:
        self.max_len, self.step_s = max_len, step_s
        self.submitted: list[Request] = []
        self.cancelled: list[str] = []
        self._running: dict[str, _Running] = {}
        self._to_cancel: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def submit(
        self,
        request: Request,
        on_token: Callable[[int, TokenLogprob | None], None],
        on_finish: Callable[[Finished], None],
    ) -> None:
        if len(request.prompt) + request.max_tokens > self.max_len:
            raise pf.InvalidInputError("request: longer than the engine's max_len")
        with self._lock:
            self.submitted.append(request)
            self._running[request.id] = _Running(request, on_token, on_finish)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self.cancelled.append(request_id)
            self._to_cancel.append(request_id)

    def stats(self) -> SchedulerStats:
        with self._lock:
            return SchedulerStats(len(self._running), 0, len(self._running) / 64, 0)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.step_s):
            with self._lock:
                gone = [self._running.pop(i) for i in self._to_cancel if i in self._running]
                self._to_cancel.clear()
                running = list(self._running.values())
            for run in gone:
                run.on_finish(Finished(run.request.id, tuple(run.tokens), "cancelled"))
            for run in running:
                prompt = run.request.prompt
                token = prompt[len(run.tokens) % len(prompt)]
                run.tokens.append(token)
                count = run.request.logprobs
                run.on_token(token, None if count is None else fake_logprob(token, count))
                stop = token in run.request.stop_ids
                if stop or len(run.tokens) == run.request.max_tokens:
                    with self._lock:
                        del self._running[run.request.id]
                    reason = "stop" if stop else "length"
                    scores = fake_prompt_logprobs(run.request)
                    run.on_finish(Finished(run.request.id, tuple(run.tokens), reason,
                                           prompt_logprobs=scores))  # fmt: skip


@contextlib.contextmanager
def serving(app: object) -> Iterator[str]:
    """``app`` served by uvicorn on a free port of 127.0.0.1 in a thread; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_S
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def chat_model(directory: pathlib.Path) -> tuple[pathlib.Path, LlamaConfig]:
    """The tiny model in ``directory`` with a Llama-2-like tokenizer_config.json and
    `TEMPLATE` there (init-tiny's own template file removed: it would be read first)."""
    config = tiny.init_tiny(directory)
    (directory / CHAT_TEMPLATE_FILE).unlink()
    settings = {
        "add_bos_token": True,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": TEMPLATE,
    }
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(settings))
    return directory, config
