"""Helpers shared by the llama tests: a tiny Hugging Face config and directory writer, and how
long a test waits for a thread or server."""

from __future__ import annotations

import json
import pathlib

import llama_reference
from safetensors.numpy import save_file

from pallas_flash_llama.config import get_config, to_hf_config

HANG_S = 600
"""How long a test waits for the engine's thread or the server to reach a state before it fails:
a bound on a hang, far above what a loaded 2-core machine takes (compiles included)."""

TINY_HF = to_hf_config(get_config("tiny")) | {
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "rms_norm_eps": 1e-6,
}
"""A tiny Hugging Face config.json with Llama-3 RoPE scaling (its band reaches these heads)."""


def write_hf_dir(directory: pathlib.Path, hf: dict, seed: int = 0) -> dict:
    """A Hugging Face model directory written with safetensors directly (not the package);
    returns the weights written."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = llama_reference.random_hf_weights(hf, seed)
    (directory / "config.json").write_text(json.dumps(hf))
    save_file(weights, directory / "model.safetensors")
    return weights
