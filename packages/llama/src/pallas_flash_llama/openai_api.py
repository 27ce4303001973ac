"""The OpenAI API's request bodies and error body, as pydantic models (`server`'s types).

Only what `server` serves: ``/v1/completions`` and ``/v1/chat/completions`` with ``n``
choices (up to `MAX_CHOICES`), text or token-id prompts, temperature, top-p, seed, stop
strings, streaming, ``logprobs`` (completions: an int, with ``echo`` the prompt's too; chat:
``logprobs`` and ``top_logprobs``), ``logit_bias``, the presence and frequency penalties, and
vLLM's extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output`` and ``prompt_logprobs`` (as
vLLM's ``SamplingParams`` define them, `logit_processing`; a prompt's logprobs only in a
whole answer, not streamed).

No field is accepted and then ignored (`refuse_unserved`): a field of OpenAI's or vLLM's API
that this server does not implement is refused with a 400 naming it unless it holds its no-op
value (`NO_OP_VALUES`: ``best_of: 1``, ``response_format: {"type": "text"}``, ...); fields that only
name or file the request (`BOOKKEEPING`: ``user``, ``metadata``, ...) are accepted; any other
field is refused as OpenAI refuses it ("Unrecognized request argument").
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from pallas_flash_llama.logit_processing import LogitProcessing
from pallas_flash_llama.logprobs import MAX_LOGPROBS

MAX_CHOICES = 16
"""The most choices (``n``) one request may ask for; each is a sequence of its own in the
engine."""

NO_OP_VALUES: dict[str, tuple[object, ...]] = {
    # OpenAI's
    "echo": (False,), "best_of": (1,),
    "suffix": ("",), "response_format": ({"type": "text"},), "tools": ([],),
    "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "modalities": (["text"],), "audio": (), "prediction": (), "reasoning_effort": (),
    "verbosity": (), "web_search_options": (),
    # vLLM's extensions
    "use_beam_search": (False,), "length_penalty": (1, 1.0),
    "allowed_token_ids": (), "bad_words": ([],), "truncate_prompt_tokens": (),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "add_special_tokens": (), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "guided_decoding_backend": (), "structured_outputs": (),
    "logits_processors": (), "return_tokens_as_token_ids": (False,),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template": (),
    "chat_template_kwargs": ({},), "documents": (), "priority": (0,),
}  # fmt: skip
"""Fields of OpenAI's and vLLM's APIs this server does not implement, each with the values
(besides null) that ask for nothing: any other value is refused (`refuse_unserved`)."""

BOOKKEEPING = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key",
                         "safety_identifier", "parallel_tool_calls", "request_id"})  # fmt: skip
"""Fields that name, file or route the request and change no token of the answer."""


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

    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = pydantic.Field(None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = pydantic.Field(0.0, ge=-2, le=2)
    frequency_penalty: float = pydantic.Field(0.0, ge=-2, le=2)
    repetition_penalty: float = pydantic.Field(1.0, gt=0)
    min_p: float = pydantic.Field(0.0, ge=0, le=1)
    min_tokens: int = pydantic.Field(0, ge=0)

    @pydantic.field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not token.isdigit():
                raise ValueError(f"logit_bias: expected token ids as keys, got {token!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias: expected values in [-100, 100], got {value}")
        return bias

    @property
    def processing(self) -> LogitProcessing | None:
        """The logit edits asked for (`logit_processing`), or None: none."""
        edits = LogitProcessing(
            logit_bias=tuple((int(t), v) for t, v in (self.logit_bias or {}).items()),
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
        )
        return None if edits == LogitProcessing() else edits

    @pydantic.model_validator(mode="after")
    def _prompt_logprobs_whole(self) -> _Sampled:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not supported with stream")
        return self

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per generated token to score, or None: none scored (each endpoint
        asks for them in its own fields)."""
        raise NotImplementedError

    @property
    def prompt_logprob_count(self) -> int | None:
        """Alternatives per prompt token to score, or None: none scored."""
        return self.prompt_logprobs

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


def _no_op(value: object, allowed: tuple[object, ...]) -> bool:
    """Whether ``value`` is null or one of ``allowed``, of the same type (``0`` is not
    ``false``: ``logprobs: 0`` asks for the sampled token's)."""
    return value is None or any(type(value) is type(a) and value == a for a in allowed)


def refuse_unserved(body: pydantic.BaseModel) -> None:
    """Raises a 400 `ApiError` naming the first field of ``body`` beyond its declared ones that
    asks for something this server does not do (module doc)."""
    for name, value in (body.model_extra or {}).items():
        if name in BOOKKEEPING:
            continue
        if name not in NO_OP_VALUES:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", name)
        if not _no_op(value, NO_OP_VALUES[name]):
            raise ApiError(400, f"{name}: not supported by this server", name)


class CompletionRequest(_Sampled):
    """POST /v1/completions: one prompt, a string or token ids (a list of one of them too)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = pydantic.Field(16, ge=1)
    logprobs: int | None = pydantic.Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @pydantic.model_validator(mode="after")
    def _echo_scored_whole(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None and self.stream:
            raise ValueError("echo: with logprobs, not supported with stream")
        return self

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprob_count(self) -> int | None:
        """``prompt_logprobs``, or with ``echo`` the prompt's tokens' ``logprobs``."""
        counts = [self.prompt_logprobs, self.logprobs if self.echo else None]
        return max((c for c in counts if c is not None), default=None)

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
    logprobs: bool = False
    top_logprobs: int | None = pydantic.Field(None, ge=0, le=MAX_LOGPROBS)

    @pydantic.model_validator(mode="after")
    def _top_with_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: expected logprobs set to true with it")
        return self

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(pydantic.BaseModel):
    """POST /tokenize (vLLM's): a ``prompt`` (special tokens added unless
    ``add_special_tokens`` is false) or chat ``messages``, one of them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @pydantic.model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt, messages: expected exactly one of them")
        return self


class DetokenizeRequest(pydantic.BaseModel):
    """POST /detokenize (vLLM's): token ids to text."""

    model: str | None = None
    tokens: list[int]
