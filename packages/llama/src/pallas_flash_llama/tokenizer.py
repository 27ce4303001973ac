"""The model's tokenizer: a Hugging Face ``tokenizer.json`` read with the tokenizers library."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import pallas_flash as pf
from pallas_flash_llama.config import LlamaConfig

TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
"""The tiny tokenizer's special tokens: ids 0 (padding), 1 (bos) and 2 (eos), as `CONFIGS`'s
``tiny`` expects."""


def load_tokenizer(directory: str | pathlib.Path) -> Tokenizer:
    """The ``tokenizer.json`` of a model directory.

    Raises:
      pf.InvalidInputError: the directory has no tokenizer.json.
    """
    path = pathlib.Path(directory) / TOKENIZER_FILE
    if not path.exists():
        raise pf.InvalidInputError(f"model: no {TOKENIZER_FILE} in {directory}")
    return Tokenizer.from_file(str(path))


TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""A directory's chat template on its own (transformers reads it before the one in
``tokenizer_config.json``: `chat_template.load_chat_template`)."""


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """What leads and ends every encoded text of a model directory (`special_tokens`):
    ``bos_id`` and ``eos_id`` (None: nothing), or ``post_processor``: the ones
    ``tokenizer.json``'s own post-processor adds."""

    bos_id: int | None = None
    eos_id: int | None = None
    post_processor: bool = False


def _token_id(tokenizer: Tokenizer, token: object, fallback: int | None) -> int | None:
    """The id of a ``tokenizer_config.json`` token (a string, or an added token's dict)."""
    content = token.get("content") if isinstance(token, dict) else token
    found = tokenizer.token_to_id(content) if isinstance(content, str) else None
    return fallback if found is None else found


def special_tokens(
    directory: str | pathlib.Path, tokenizer: Tokenizer, config: LlamaConfig
) -> SpecialTokens:
    """The special tokens transformers would add to a text of ``directory``:

    - ``tokenizer_config.json`` sets ``add_bos_token`` or ``add_eos_token``: they decide, as
      transformers' Llama tokenizers rebuild their post-processor from them: its
      ``bos_token`` (else ``config.json``'s ``bos_token_id``) leads unless ``add_bos_token``
      is false, its ``eos_token`` (else the first of ``eos_token_id``) ends if
      ``add_eos_token`` is true;
    - else, where ``tokenizer.json`` has a post-processor, it adds what it adds (Llama 3's
      ``<|begin_of_text|>``);
    - else, a directory without ``tokenizer_config.json`` (this package's tiny model) is led
      by ``config.json``'s ``bos_token_id``; one with it, by nothing.
    """
    path = pathlib.Path(directory) / TOKENIZER_CONFIG_FILE
    settings = json.loads(path.read_text()) if path.exists() else None
    if settings is not None and ({"add_bos_token", "add_eos_token"} & settings.keys()):
        eos = config.eos_ids[0] if config.eos_ids else None
        return SpecialTokens(
            bos_id=_token_id(tokenizer, settings.get("bos_token"), config.bos_id)
            if settings.get("add_bos_token", True) else None,
            eos_id=_token_id(tokenizer, settings.get("eos_token"), eos)
            if settings.get("add_eos_token", False) else None,
        )  # fmt: skip
    if tokenizer.post_processor is not None:
        return SpecialTokens(post_processor=True)
    return SpecialTokens(bos_id=config.bos_id if settings is None else None)


def encode(tokenizer: Tokenizer, text: str, special: SpecialTokens) -> list[int]:
    """Token ids of ``text`` with the directory's special tokens (`special_tokens`)."""
    ids = tokenizer.encode(text, add_special_tokens=special.post_processor).ids
    lead = [] if special.bos_id is None else [special.bos_id]
    end = [] if special.eos_id is None else [special.eos_id]
    return [*lead, *ids, *end]


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens trained on ``texts``, with
    `SPECIAL_TOKENS` first (every byte is a token, so any text encodes)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer
