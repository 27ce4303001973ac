"""Scored tokens (`logprobs.TokenLogprob`) as the OpenAI API's logprobs objects, as vLLM's
server writes them.

- Completions (`completion_logprobs`), OpenAI's legacy object: ``tokens`` (each token's text),
  ``token_logprobs``, ``top_logprobs`` (each token's alternatives and itself, by text: up to
  ``logprobs + 1`` entries, as vLLM's) and ``text_offset`` (where each token's text starts in
  the choice's text). A prompt's first token, echoed, has no logprob: null.
- Chat (`chat_logprobs`): ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``
  with exactly ``top_logprobs`` alternatives.
- ``prompt_logprobs`` (`prompt_logprobs`, vLLM's): per prompt token, null for the first, else
  ``{token id: {"logprob", "rank", "decoded_token"}}`` for the token and its alternatives.

A token's text is its id decoded alone (special tokens skipped, as in the choice's text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from pallas_flash_llama.logprobs import TokenLogprob

Scored = tuple[int, TokenLogprob | None]
"""A token id and its logprob (None: a prompt's first token)."""


def completion_logprobs(tokenizer: Tokenizer, scored: Sequence[Scored], count: int,
                        offset: int = 0) -> dict[str, list[Any]]:  # fmt: skip
    """The completions ``logprobs`` of ``scored`` tokens with ``count`` alternatives each,
    their text starting at character ``offset`` of the choice's text (module doc)."""
    texts = [tokenizer.decode([token]) for token, _ in scored]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    tops: list[dict[str, float] | None] = []
    for token, logprob in scored:
        if logprob is None:
            tops.append(None)
            continue
        alternatives = {tokenizer.decode([t]): value for t, value in logprob.top[:count]}
        tops.append({**alternatives, tokenizer.decode([token]): logprob.logprob})
    return {
        "tokens": texts,
        "token_logprobs": [None if lp is None else lp.logprob for _, lp in scored],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _chat_entry(tokenizer: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Tokenizer, scored: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` of generated tokens (module doc)."""
    content = [
        {**_chat_entry(tokenizer, lp.token, lp.logprob),
         "top_logprobs": [_chat_entry(tokenizer, t, value) for t, value in lp.top]}
        for lp in scored
    ]  # fmt: skip
    return {"content": content}


def prompt_logprobs(tokenizer: Tokenizer, scored: Sequence[TokenLogprob | None],
                    count: int) -> list[dict[str, Any] | None]:  # fmt: skip
    """vLLM's ``prompt_logprobs`` of a prompt's tokens, ``count`` alternatives each (module
    doc)."""
    found: list[dict[str, Any] | None] = []
    for logprob in scored:
        if logprob is None:
            found.append(None)
            continue
        ranked = [*((t, value, rank) for rank, (t, value) in enumerate(logprob.top[:count], 1)),
                  (logprob.token, logprob.logprob, logprob.rank)]  # fmt: skip
        found.append({str(t): {"logprob": value, "rank": rank,
                               "decoded_token": tokenizer.decode([t])}
                      for t, value, rank in ranked})  # fmt: skip
    return found
