"""Which special tokens lead and end a text, as transformers would add them for the same
model directory (`tokenizer.special_tokens`)."""

from __future__ import annotations

import json
import pathlib

import pytest
from tokenizers import processors

from pallas_flash_llama.config import get_config
from pallas_flash_llama.tokenizer import encode, special_tokens, train_byte_level_bpe

TEXT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def tokenizer():
    return train_byte_level_bpe([TEXT] * 8, vocab_size=300)


def _ids(tokenizer, directory: pathlib.Path) -> list[int]:
    config = get_config("tiny")
    return encode(tokenizer, TEXT, special_tokens(directory, tokenizer, config))


def _write(directory: pathlib.Path, settings: dict) -> pathlib.Path:
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def test_tokenizer_config_decides_the_bos_and_eos(tokenizer, tmp_path: pathlib.Path) -> None:
    plain = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert get_config("tiny").bos_id == 1 and get_config("tiny").eos_ids[0] == 2
    no_bos = _write(tmp_path, {"add_bos_token": False, "bos_token": "<s>"})
    assert _ids(tokenizer, no_bos) == plain, "add_bos_token false: no bos, as transformers"
    both = _write(tmp_path, {"add_bos_token": True, "add_eos_token": True,
                             "bos_token": {"content": "<s>"}, "eos_token": "</s>"})  # fmt: skip
    assert _ids(tokenizer, both) == [1, *plain, 2]
    eos_only = _write(tmp_path, {"add_eos_token": True, "eos_token": "</s>"})
    assert _ids(tokenizer, eos_only) == [1, *plain, 2], "add_bos_token defaults to true"


def test_without_flags_the_post_processor_decides(tokenizer, tmp_path: pathlib.Path) -> None:
    plain = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert _ids(tokenizer, tmp_path) == [1, *plain], "no tokenizer_config: config's bos"
    _write(tmp_path, {"bos_token": "<s>"})
    assert _ids(tokenizer, tmp_path) == plain, "a config without the flags nor a post-processor"
    templated = train_byte_level_bpe([TEXT] * 8, vocab_size=300)
    templated.post_processor = processors.TemplateProcessing(
        single="</s> $A", special_tokens=[("</s>", 2)]
    )
    assert _ids(templated, tmp_path) == [2, *plain], "the post-processor's, not config's bos"
