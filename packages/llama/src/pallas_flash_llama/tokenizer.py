"""The model's tokenizer: a Hugging Face ``tokenizer.json`` read with the tokenizers library."""

from __future__ import annotations

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


def encode(tokenizer: Tokenizer, text: str, config: LlamaConfig) -> list[int]:
    """Token ids of ``text``, led by the config's bos token when it has one."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return ids if config.bos_id is None else [config.bos_id, *ids]


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
