"""The OpenAI API's request bodies and error body, as pydantic models (`server`'s types).

Only what `server` serves: ``/v1/completions`` and ``/v1/chat/completions`` with ``n``
choices (up to `MAX_CHOICES`), text or token-id prompts, temperature, top-p, ``top_k`` (an
extension, as vLLM has it), seed, stop strings and streaming. Fields of the API that are not
listed here are ignored, as OpenAI-compatible servers do; those that would change the answer
and are not served (``logprobs``, ``echo``, ``best_of``, ``suffix``, tools) are refused with
a 400.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

MAX_CHOICES = 16
"""The most choices (``n``) one request may ask for; each is a sequence of its own in the
engine."""

UNSERVED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "functions")
"""Request fields that would change the answer and that this server does not implement."""


class ApiError(Exception):
    """An error answered with OpenAI's error body (`error_body`) and HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        """OpenAI's error type for the status."""
        return "invalid_request_error" if self.status < 500 else "server_error"


def error_body(error: ApiError) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI answers an error."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param,
                      "code": error.code}}  # fmt: skip


class StreamOptions(pydantic.BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (no choices)."""

    include_usage: bool = False


class _Sampled(pydantic.BaseModel):
    """What both endpoints take: the model, sampling, stops, streaming."""

    model_config = pydantic.ConfigDict(extra="allow")

    model: str | None = None
    temperature: float = pydantic.Field(1.0, ge=0, le=2)
    top_p: float | None = pydantic.Field(None, gt=0, le=1)
    top_k: int | None = pydantic.Field(None, ge=-1, description="extension; -1 or 0: off")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = pydantic.Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @pydantic.model_validator(mode="after")
    def _served(self) -> _Sampled:
        for name in UNSERVED:
            value = (self.model_extra or {}).get(name)
            if value and not (name == "best_of" and value == 1):
                raise ValueError(f"{name}: not supported by this server")
        return self

    @pydantic.field_validator("stop")
    @classmethod
    def _non_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop is not None and not all(stop if isinstance(stop, list) else [stop]):
            raise ValueError("stop: expected non-empty strings")
        return stop

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (a single string is one stop)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampled):
    """POST /v1/completions: one prompt, a string or token ids (a list of one of them too)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = pydantic.Field(16, ge=1)

    @pydantic.field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(
                    f"prompt: one prompt per request, got {len(prompt)}: send each on its own"
                )
            prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt: expected a non-empty string or list of token ids")
        return prompt


class TextPart(pydantic.BaseModel):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(pydantic.BaseModel):
    """One message; other fields (``name``, ...) go to the chat template as they are."""

    model_config = pydantic.ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it: content parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content}


class ChatCompletionRequest(_Sampled):
    """POST /v1/chat/completions: messages rendered by the model's chat template."""

    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_tokens: int | None = pydantic.Field(None, ge=1)
    max_completion_tokens: int | None = pydantic.Field(None, ge=1)
