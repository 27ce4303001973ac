"""Hugging Face LLaMa weights (``*.safetensors``) to the model's parameters and back.

A model directory holds ``config.json``, the weights as one ``model.safetensors`` or as shards
listed by ``model.safetensors.index.json`` (``weight_map``: tensor name -> file), and usually
``tokenizer.json``. Hugging Face stores a linear layer as ``[out, in]``; the model keeps
``[in, ...out]`` (`model.param_shapes`), so matmul weights are transposed and reshaped on the
way in and out. Each parameter is read on the host and placed straight into its sharding
(each device receives only its own shard).
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

import pallas_flash as pf
from pallas_flash.mesh_placement import to_host
from pallas_flash_llama import distributed, sharding
from pallas_flash_llama.config import LlamaConfig, load_hf_config, to_hf_config
from pallas_flash_llama.model import Params, param_shapes

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
}
"""Layer parameter -> its Hugging Face module under ``model.layers.{i}.``."""

HF_TOP_NAMES = {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
"""Parameter outside the layers -> its Hugging Face module."""

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Tensors some checkpoints carry that the model recomputes."""


def _in_axes(name: str) -> int:
    """How many leading axes of a (per-layer) matmul weight are its input axes."""
    return 2 if name == "wo" else 1


def _is_linear(name: str) -> bool:
    return name not in ("embed", "attn_norm", "mlp_norm", "final_norm")


def _hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of a parameter (one layer's) of the model's ``shape``."""
    if not _is_linear(name):
        return shape
    split = _in_axes(name)
    return (math.prod(shape[split:]), math.prod(shape[:split]))


def _to_model(name: str, tensor: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A Hugging Face tensor in the model's layout ``shape`` (one layer's)."""
    return tensor.T.reshape(shape) if _is_linear(name) else tensor


def _to_hf(name: str, array: np.ndarray) -> np.ndarray:
    """A parameter (one layer's) in Hugging Face's layout."""
    if not _is_linear(name):
        return array
    fan_in = math.prod(array.shape[: _in_axes(name)])
    return np.ascontiguousarray(array.reshape(fan_in, -1).T)


def _hf_tensor_names(config: LlamaConfig) -> dict[str, list[str]]:
    """Parameter path (``"layers/wq"``) -> the Hugging Face tensors it is made of."""
    names = {
        name: [f"{module}.weight"]
        for name, module in HF_TOP_NAMES.items()
        if name != "lm_head" or not config.tie_embeddings
    }
    for name, module in HF_LAYER_NAMES.items():
        names[f"layers/{name}"] = [
            f"model.layers.{i}.{module}.weight" for i in range(config.layers)
        ]
    return names


def _tensor_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the safetensors file holding it."""
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / SINGLE_FILE
    if not single.exists():
        raise pf.InvalidInputError(
            f"model: expected {SINGLE_FILE} or {INDEX_FILE} in {directory}, found neither"
        )
    with safe_open(single, framework="numpy") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def _reader(files: dict[str, pathlib.Path]) -> Callable[[str], np.ndarray]:
    """A function reading one named tensor, keeping each file open once."""
    handles: dict[pathlib.Path, object] = {}

    def read(name: str) -> np.ndarray:
        path = files[name]
        if path not in handles:
            handles[path] = safe_open(path, framework="numpy")
        return handles[path].get_tensor(name)

    return read


def load_params(
    directory: str | pathlib.Path,
    config: LlamaConfig | None = None,
    mesh: Mesh | None = None,
) -> tuple[LlamaConfig, Params]:
    """The config and parameters of a Hugging Face LLaMa directory.

    Args:
      directory: holds ``config.json`` and the safetensors weights (see the module doc).
      config: overrides the directory's config (e.g. ``dtype``); its shapes must match.
      mesh: place each parameter in its `sharding.param_shardings` sharding; default: the
        default device.

    Returns:
      ``(config, params)``, params in ``config.param_dtype``.

    Raises:
      pf.InvalidInputError: a tensor is missing, has the wrong shape or is unexpected (the
        message names it), or the directory has no weights.
    """
    directory = pathlib.Path(directory)
    config = load_hf_config(directory) if config is None else config
    files = _tensor_files(directory)
    read = _reader(files)
    wanted = _hf_tensor_names(config)
    known = {name for names in wanted.values() for name in names}
    if config.tie_embeddings:
        known.add("lm_head.weight")  # some tied checkpoints store the copy anyway
    unexpected = sorted(n for n in files if n not in known and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise pf.InvalidInputError(
            f"weights: unexpected tensors {unexpected[:5]} in {directory} for this config "
            f"({config.layers} layers, tie_embeddings={config.tie_embeddings})"
        )
    shapes = param_shapes(config)
    shardings = None if mesh is None else sharding.param_shardings(config, mesh)
    dtype = jnp.dtype(config.param_dtype)
    params: Params = {"layers": {}}
    for path, names in wanted.items():
        top, _, key = path.rpartition("/")
        shape = shapes[top][key] if top else shapes[key]
        one = shape[1:] if top else shape
        pieces = []
        for name in names:
            if name not in files:
                raise pf.InvalidInputError(f"weights: missing tensor {name!r} in {directory}")
            tensor = read(name)
            expected = _hf_shape(key, one)
            if tensor.shape != expected:
                raise pf.InvalidInputError(
                    f"weights: tensor {name!r} expected shape {expected}, got {tensor.shape}"
                )
            pieces.append(_to_model(key, tensor, one).astype(dtype))
        host = np.stack(pieces) if top else pieces[0]
        target = None
        if shardings is not None:
            target = shardings[top][key] if top else shardings[key]
        array = (
            jax.device_put(host)
            if target is None
            else jax.make_array_from_callback(host.shape, target, lambda index, h=host: h[index])
        )
        if top:
            params[top][key] = array
        else:
            params[key] = array
    return config, params


def save_params(
    directory: str | pathlib.Path,
    params: Params,
    config: LlamaConfig,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Writes ``config.json`` and the weights as Hugging Face LLaMa safetensors (in a job
    over several processes: every process calls it, process 0 writes).

    Args:
      dtype: the dtype to store (default: the parameters' own, so a reload is exact).
      max_shard_bytes: above this the weights are split into ``model-0000i-of-0000n``
        files listed by ``model.safetensors.index.json``.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    main = distributed.is_main()
    tensors: dict[str, np.ndarray] = {}
    for path, names in _hf_tensor_names(config).items():
        top, _, key = path.rpartition("/")
        array = to_host(params[top][key] if top else params[key])  # every process gathers
        if not main:
            continue  # process 0 alone converts and writes
        if dtype is not None:
            array = array.astype(jnp.dtype(dtype))
        for i, name in enumerate(names):
            tensors[name] = _to_hf(key, array[i] if top else array)
    if not main:
        return
    stored = next(iter(tensors.values())).dtype
    hf = to_hf_config(config) | {
        "torch_dtype": "bfloat16" if stored == jnp.bfloat16 else str(stored)
    }
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], directory / SINGLE_FILE, metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}}
    index["weight_map"] = weight_map
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
