"""Hugging Face directories: configs, loading, saving, and named errors for bad weights."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from llama_testing import TINY_HF, write_hf_dir
from safetensors.numpy import save_file

import pallas_flash as pf
from pallas_flash_llama import model
from pallas_flash_llama.config import CONFIGS, from_hf_config, get_config, to_hf_config
from pallas_flash_llama.weights import INDEX_FILE, load_params, save_params


def test_unknown_config_name_lists_the_known_ones() -> None:
    with pytest.raises(pf.InvalidInputError, match="llama-3-8b"):
        get_config("llama-9")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_configs_round_trip_through_config_json(name: str) -> None:
    config = get_config(name)
    assert from_hf_config(json.loads(json.dumps(to_hf_config(config)))) == config


def test_llama3_config_json() -> None:
    """The fields of Meta-Llama-3.1-8B's config.json."""
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
    }
    config = from_hf_config(hf)
    assert (config.head_dim, config.kv_heads, config.eos_ids) == (128, 8, (128001, 128008, 128009))
    assert config.rope_scaling.factor == 8.0 and config.num_params == 8_030_261_248


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mistral"}, "model_type"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"num_key_value_heads": 3}, "kv_heads"),
    ],
)
def test_bad_config_json_is_named(change: dict, message: str) -> None:
    with pytest.raises(pf.InvalidInputError, match=message):
        from_hf_config(TINY_HF | change)


def test_missing_config_key_is_named() -> None:
    hf = dict(TINY_HF)
    del hf["hidden_size"]
    with pytest.raises(pf.InvalidInputError, match="hidden_size"):
        from_hf_config(hf)


def _logits(config, params) -> np.ndarray:
    tokens = np.arange(24, dtype=np.int32)[None] % config.vocab
    return np.asarray(model.forward(params, tokens, config.replace(dtype="float32"), backend="xla"))


@pytest.mark.parametrize("max_shard_bytes", [4 << 30, 100_000])
def test_save_and_reload_gives_identical_logits(hf_dir, tmp_path, max_shard_bytes: int) -> None:
    config, params = load_params(hf_dir[0])
    save_params(tmp_path, params, config, max_shard_bytes=max_shard_bytes)
    assert (tmp_path / INDEX_FILE).exists() == (max_shard_bytes < 4 << 30)
    reloaded_config, reloaded = load_params(tmp_path)
    assert reloaded_config == config
    np.testing.assert_array_equal(_logits(config, params), _logits(config, reloaded))


def test_saved_tensors_are_the_hugging_face_ones(hf_dir, tmp_path) -> None:
    """Loading then saving gives back the very tensors written (names, layout, values)."""
    from safetensors.numpy import load_file

    config, params = load_params(hf_dir[0])
    save_params(tmp_path, params, config)
    saved = load_file(tmp_path / "model.safetensors")
    assert saved.keys() == hf_dir[1].keys()
    for name, tensor in hf_dir[1].items():
        np.testing.assert_array_equal(saved[name], tensor, err_msg=name)


def test_tied_embeddings_need_no_lm_head(tmp_path) -> None:
    hf = TINY_HF | {"tie_word_embeddings": True}
    write_hf_dir(tmp_path, hf)
    config, params = load_params(tmp_path)
    assert config.tie_embeddings and "lm_head" not in params


def _broken(tmp_path, edit) -> None:
    weights = write_hf_dir(tmp_path, TINY_HF)
    edit(weights)
    save_file(weights, tmp_path / "model.safetensors")


def test_missing_tensor_is_named(tmp_path) -> None:
    _broken(tmp_path, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(pf.InvalidInputError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_params(tmp_path)


def test_mismatched_tensor_is_named(tmp_path) -> None:
    def edit(w):
        w["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)

    _broken(tmp_path, edit)
    with pytest.raises(pf.InvalidInputError, match=r"k_proj\.weight.*\(32, 64\).*\(8, 64\)"):
        load_params(tmp_path)


def test_unexpected_tensor_is_named(tmp_path) -> None:
    def edit(w):
        w["model.layers.2.input_layernorm.weight"] = np.ones(64, np.float32)

    _broken(tmp_path, edit)
    with pytest.raises(pf.InvalidInputError, match=r"model\.layers\.2\.input_layernorm"):
        load_params(tmp_path)


def test_directory_without_weights_is_named(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    with pytest.raises(pf.InvalidInputError, match=r"model\.safetensors"):
        load_params(tmp_path)
    with pytest.raises(pf.InvalidInputError, match=r"config\.json"):
        load_params(tmp_path / "nowhere")


def test_load_straight_to_a_sharding(hf_dir) -> None:
    from pallas_flash_llama.sharding import make_mesh, param_shardings

    mesh = make_mesh(data=1, fsdp=2, tensor=2, devices=jax.devices()[:4])
    config, params = load_params(hf_dir[0], mesh=mesh)
    want = param_shardings(config, mesh)
    for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        assert got.sharding == expected
