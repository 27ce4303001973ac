"""``pallas-flash-llama init-tiny DIR``: a complete, tiny, randomly initialised model directory.

What a downloaded Hugging Face LLaMa directory holds, small enough for a CPU: ``config.json``
(the ``tiny`` config), ``model.safetensors`` (float32 weights), ``tokenizer.json`` (byte-level
BPE trained on `SAMPLE_TEXT`), ``chat_template.jinja`` (`CHAT_TEMPLATE`, so that chat
clients can talk to it), and ``sample.txt`` to train on.
"""

from __future__ import annotations

import pathlib

import jax

from pallas_flash_llama.config import LlamaConfig, get_config
from pallas_flash_llama.model import init_params
from pallas_flash_llama.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_FILE, train_byte_level_bpe
from pallas_flash_llama.weights import save_params

SAMPLE_FILE = "sample.txt"

SAMPLE_TEXT = """\
The quick brown fox jumps over the lazy dog.
A tiny model learns the shape of its data before it learns anything else.
Attention is a weighted average of values, weighted by how well keys match a query.
Flash attention computes it in blocks, keeping a running maximum and a running sum.
The key and value cache grows by one row for every generated token.
Packed sequences share a row; segment ids keep their attention apart.
On a TPU the matrix units want large blocks and the memory wants few passes.
Once upon a time there was a small language model that wanted to be fast.
It trained on a few lines of text, again and again, until the loss went down.
Then it generated text, one token at a time, reading its cache.
"""
"""The text the tiny tokenizer is trained on, and ``sample.txt``."""

CHAT_TEMPLATE = (
    "<s>{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
"""The tiny model's chat template: bos (``<s>``), then each message as ``role: content`` on a
line, then ``assistant:`` for the reply."""


def init_tiny(directory: str | pathlib.Path, seed: int = 0) -> LlamaConfig:
    """Writes the tiny model directory (see the module doc) and returns its config."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = get_config("tiny")
    params = init_params(config, jax.random.key(seed))
    save_params(directory, params, config)
    lines = SAMPLE_TEXT.splitlines()
    train_byte_level_bpe(lines, config.vocab).save(str(directory / TOKENIZER_FILE))
    (directory / CHAT_TEMPLATE_FILE).write_text(CHAT_TEMPLATE)
    (directory / SAMPLE_FILE).write_text(SAMPLE_TEXT * 8)
    return config
