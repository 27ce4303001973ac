"""What the server refuses before it does any work on a request: a body over its size limit
(413), text no tokenizer can encode (a lone UTF-16 surrogate, 400) and a prompt too long for
the context whatever its tokens (400), each without tokenising it.

`BodyLimit` counts a request's body as it arrives (its ``Content-Length`` first), so a body
over the limit is neither buffered whole nor parsed. `surely_too_long`: no token stands for more
of a text than the tokenizer's longest vocabulary entry (`longest_token_bytes`), so a text of
more characters (each at least a byte) than ``max_len`` such tokens hold is longer than the
context once tokenised.
"""

from __future__ import annotations

from typing import Any

import starlette.exceptions
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tokenizers import Tokenizer

from pallas_flash_llama.openai_api import ApiError

MAX_REQUEST_BYTES = 32 * 2**20
"""The default limit on a request's body (32 MiB), `BodyLimit`'s."""

NORMALIZER_SLACK = 2
"""How much a tokenizer's normaliser may shorten a text (NFKC composes a few characters into
one), a margin `surely_too_long` leaves."""


class BodyLimit:
    """ASGI middleware: a 413 (`starlette.exceptions.HTTPException`, which the app answers in
    OpenAI's body) once a request's body, declared or received, exceeds ``limit`` bytes."""

    def __init__(self, app: ASGIApp, limit: int = MAX_REQUEST_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        received = 0

        async def limited() -> Message:
            nonlocal received
            if declared is not None and declared.isdigit() and int(declared) > self.limit:
                raise self._too_large()
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise self._too_large()
            return message

        await self.app(scope, limited, send)

    def _too_large(self) -> starlette.exceptions.HTTPException:
        return starlette.exceptions.HTTPException(
            413, f"Request body too large: the limit is {self.limit} bytes"
        )


def unicode_text(text: str, field: str) -> str:
    """``text``, or a 400 naming ``field`` where it holds a lone UTF-16 surrogate (which no
    tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        where = f"{text[error.start]!r} at character {error.start}"
        raise ApiError(400, f"{field}: invalid Unicode: a lone surrogate {where}", field) from None
    return text


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """UTF-8 bytes of the tokenizer's longest vocabulary entry (added tokens included): no
    token stands for more of a text (a byte-level entry spells each byte with one character,
    a SentencePiece one its space as ``▁``: never fewer bytes than it stands for)."""
    vocab: dict[str, Any] = tokenizer.get_vocab(with_added_tokens=True)
    return max(len(token.encode("utf-8")) for token in vocab)


def surely_too_long(text: str, max_len: int, token_bytes: int) -> bool:
    """Whether ``text`` holds more tokens than ``max_len`` whatever the tokenizer makes of it
    (module doc; `NORMALIZER_SLACK` spared), judged by its length alone."""
    return len(text) > NORMALIZER_SLACK * max_len * token_bytes
