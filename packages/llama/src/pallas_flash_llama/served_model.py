"""The served model as the OpenAI API sees it (`ServedModel`): its name, tokenizer and special
tokens, eos ids and chat template, read from a model directory."""

from __future__ import annotations

import dataclasses
import pathlib
import time

from tokenizers import Tokenizer

from pallas_flash_llama.chat_template import (
    ChatTemplate,
    load_chat_template,
    special_token_strings,
)
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.server_limits import longest_token_bytes
from pallas_flash_llama.tokenizer import SpecialTokens, load_tokenizer, special_tokens


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
    token_bytes: int
    """The longest vocabulary entry's UTF-8 bytes (`server_limits.longest_token_bytes`)."""
    special_strings: dict[str, str]
    """The special tokens as text (``bos_token``, ``eos_token``, ...): ``tokenizer_config.json``'s,
    else the config's bos and first eos id's."""


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
        token_bytes=longest_token_bytes(tokenizer),
        special_strings=_special_strings(directory, tokenizer, config),
    )


def _special_strings(directory: str | pathlib.Path, tokenizer: Tokenizer,
                     config: LlamaConfig) -> dict[str, str]:  # fmt: skip
    ids = {"bos_token": config.bos_id, "eos_token": config.eos_ids[0] if config.eos_ids else None}
    found = {name: tokenizer.id_to_token(i) for name, i in ids.items() if i is not None}
    return {**{k: v for k, v in found.items() if v is not None},
            **special_token_strings(directory)}  # fmt: skip
