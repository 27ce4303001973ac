"""A LLaMa-family model on Pallas-Flash's attention backends: train and generate in plain JAX.

Quick start::

    import jax
    import pallas_flash_llama as pfl

    config, params = pfl.load_params("path/to/llama-dir")     # Hugging Face layout
    logits = pfl.forward(params, tokens, config)              # [batch, seq, vocab] float32
    for step in pfl.generate(params, config, prompts, max_new_tokens=32):
        print(step)                                           # [batch] new tokens

Modules: `config` (shapes by name or config.json), `model` (parameters and forward),
`layers`, `rope`, `attention` (the calls into ``pf.attention`` / ``pf.decode``), `sharding`
(the mesh and its rules table), `weights` (safetensors), `tokenizer`, `data`, `train`,
`checkpoint` (the training state with orbax; import it on its own), `kv_cache`,
`generation`, `sampling`, `scheduler` (continuous batching's plan of each step) and
`page_pool` (its pages, shared by the prefixes requests have in common),
`engine` and `engine_step` (the serving engine that runs those plans), `int8_weights`,
`flax_attention` (an ``attention_fn`` for Flax), `abstract` (the
steps' arguments as shapes, to compile ahead of time), `tiny` and `cli`.
"""

from pallas_flash_llama.config import CONFIGS, LlamaConfig, RopeScaling, get_config
from pallas_flash_llama.flax_attention import attention_fn
from pallas_flash_llama.generation import generate, generate_all
from pallas_flash_llama.kv_cache import KVCache
from pallas_flash_llama.model import forward, init_params
from pallas_flash_llama.sampling import Sampling
from pallas_flash_llama.sharding import make_mesh
from pallas_flash_llama.train import TrainConfig, TrainState, init_state, make_train_step
from pallas_flash_llama.weights import load_params, save_params

__all__ = [
    "CONFIGS",
    "KVCache",
    "LlamaConfig",
    "RopeScaling",
    "Sampling",
    "TrainConfig",
    "TrainState",
    "attention_fn",
    "forward",
    "generate",
    "generate_all",
    "get_config",
    "init_params",
    "init_state",
    "load_params",
    "make_mesh",
    "make_train_step",
    "save_params",
]
