"""A request's generated token ids as text, sent a piece at a time (`TextStream`).

Generated ids are decoded whole after each token (as transformers decodes, special tokens
skipped) and the new suffix is sent, holding back a trailing incomplete UTF-8 character
(`HOLD`) and any tail that may begin a stop string. A stop string found in the text ends it:
the text is cut before it (after it with ``include_stop_str_in_output``); none is looked for
in the text of the first ``min_tokens`` tokens (vLLM's). A stop token (in
``stop_ids``) ends the request in the engine and is not text, unless it is to be included.
"""

from __future__ import annotations

from collections.abc import Collection

from tokenizers import Tokenizer

HOLD = "\ufffd"
"""What a decoder gives for the bytes of a character whose last bytes are yet to come."""


class TextStream:
    """A request's generated ids as text, sent a piece at a time (module doc)."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], stop_ids: Collection[int],
                 include_stop: bool = False, min_tokens: int = 0) -> None:  # fmt: skip
        self.tokenizer, self.stop, self.stop_ids = tokenizer, stop, frozenset(stop_ids)
        self.include_stop, self.min_tokens = include_stop, min_tokens
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` sent
        self.searched = 0  # where stop strings may start: after the first min_tokens' text

    def push(self, token: int) -> tuple[str, bool]:
        """The text ``token`` adds that can be sent now, and whether a stop string ended it."""
        if token in self.stop_ids and not self.include_stop:  # ends it in the engine; not text
            return "", False
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        if len(self.ids) <= self.min_tokens:  # vLLM's: no stop string before min_tokens
            self.searched = len(self.text)
        kept = len if self.include_stop else lambda stop: 0  # of a stop string found
        found = [at + kept(stop) for stop in self.stop
                 if (at := self.text.find(stop, self.searched)) >= 0]  # fmt: skip
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
