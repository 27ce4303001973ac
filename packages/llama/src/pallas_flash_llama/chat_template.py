"""A model directory's chat template, rendered with jinja2 the way transformers renders it.

The template is ``chat_template.jinja`` where the directory has one (transformers' newer
layout), else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named
templates, of which ``default``). As transformers' ``apply_chat_template``: an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, ``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps
non-ASCII text; the template sees ``messages``, ``add_generation_prompt`` and the special
tokens' strings (``bos_token``, ``eos_token``, ...). The rendered text already holds its
special tokens: it is encoded without adding any.
"""

from __future__ import annotations

import datetime
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

import pallas_flash as pf
from pallas_flash_llama.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class ChatTemplate:
    """A compiled chat template and the special tokens' strings it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        self.source, self.template = source, environment.from_string(source)
        self.special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt text of ``messages``, ending with the assistant's turn's opening.

        Raises:
          pf.InvalidInputError: the template refused the messages (``raise_exception``).
        """
        try:
            return self.template.render(
                messages=list(messages), add_generation_prompt=True, **self.special_tokens
            )
        except jinja2.exceptions.TemplateError as error:
            raise pf.InvalidInputError(
                f"messages: the chat template refused them: {error}"
            ) from None


def _token_string(token: object) -> str | None:
    """A ``tokenizer_config.json`` token: a string, or an added token's dict."""
    content = token.get("content") if isinstance(token, dict) else token
    return content if isinstance(content, str) else None


def _settings(directory: pathlib.Path) -> dict[str, Any]:
    path = directory / TOKENIZER_CONFIG_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def special_token_strings(directory: str | pathlib.Path) -> dict[str, str]:
    """``tokenizer_config.json``'s special tokens (`SPECIAL_TOKEN_NAMES`) it sets, as strings."""
    settings = _settings(pathlib.Path(directory))
    special = {name: _token_string(settings.get(name)) for name in SPECIAL_TOKEN_NAMES}
    return {name: text for name, text in special.items() if text}


def load_chat_template(directory: str | pathlib.Path) -> ChatTemplate | None:
    """The chat template of a model directory (module doc); None if it has none."""
    directory = pathlib.Path(directory)
    source = _settings(directory).get("chat_template")
    if isinstance(source, list):
        source = {entry.get("name"): entry.get("template") for entry in source}.get("default")
    if (directory / CHAT_TEMPLATE_FILE).exists():
        source = (directory / CHAT_TEMPLATE_FILE).read_text()
    if not source:
        return None
    return ChatTemplate(source, special_token_strings(directory))
