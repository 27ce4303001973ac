"""`LlamaConfig`: the shape of a LLaMa-family model, by name or from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Literal

import pallas_flash as pf

RematPolicy = Literal["none", "full", "save_qkv", "save_dots"]
"""What the backward pass keeps of each layer's forward (`model.remat`): nothing recomputed
(``none``), only the layer's input (``full``), the q/k/v projections (``save_qkv``), or every
matmul output (``save_dots``)."""

REMAT_POLICIES: tuple[str, ...] = ("none", "full", "save_qkv", "save_dots")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3's RoPE frequency scaling (Hugging Face ``rope_type: "llama3"``).

    Wavelengths shorter than ``original_max_len / high_freq_factor`` keep their frequency,
    those longer than ``original_max_len / low_freq_factor`` are divided by ``factor``, and
    the band between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape and numerics of one LLaMa-family model (hashable: a static jit argument).

    Attributes:
      vocab: tokens in the vocabulary.
      hidden: model width (``d_model``).
      layers: decoder layers.
      q_heads: query heads.
      kv_heads: key/value heads (``q_heads % kv_heads == 0``; fewer is GQA, 1 is MQA).
      head_dim: width of one head.
      mlp: SwiGLU hidden width.
      rope_theta: RoPE base.
      rope_scaling: Llama-3 frequency scaling, or None.
      norm_eps: RMSNorm epsilon.
      tie_embeddings: the output projection is the embedding's transpose.
      max_len: longest sequence the model was trained for (the default cache size cap).
      bos_id, eos_ids: beginning-of-sequence token and the tokens that end generation.
      dtype: compute dtype of matmuls and activations (``bfloat16``; ``float32`` for tests).
      param_dtype: dtype parameters are kept (and trained) in.
      remat: the training remat policy (`RematPolicy`).
      scan_layers: layers run under ``lax.scan`` over the stacked axis (one layer compiled);
        when False, as a Python loop that slices each layer's parameters out of the stacked
        arrays (every layer compiled separately: slower to compile, for comparison).
      loss_chunk: the training loss's float32 logits are made this many positions of the
        sequence at a time (`loss.next_token_loss`), and remade in the backward, so the whole
        ``[batch, seq, vocab]`` logits never exist; None: all at once.
    """

    vocab: int
    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    rope_theta: float = 500_000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_len: int = 8192
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    remat: RematPolicy = "none"
    scan_layers: bool = True
    loss_chunk: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "layers", "q_heads", "kv_heads", "head_dim", "mlp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise pf.InvalidInputError(f"{name}: expected a positive int, got {value!r}")
        if self.q_heads % self.kv_heads:
            raise pf.InvalidInputError(
                f"kv_heads: expected a divisor of q_heads={self.q_heads}, got {self.kv_heads}"
            )
        if self.remat not in REMAT_POLICIES:
            raise pf.InvalidInputError(
                f"remat: expected one of {REMAT_POLICIES}, got {self.remat!r}"
            )
        if not isinstance(self.scan_layers, bool):
            raise pf.InvalidInputError(f"scan_layers: expected a bool, got {self.scan_layers!r}")
        chunk = self.loss_chunk
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise pf.InvalidInputError(
                f"loss_chunk: expected None or a positive int, got {chunk!r}"
            )

    def replace(self, **changes: Any) -> LlamaConfig:
        """A copy with some fields changed (``config.replace(dtype="float32")``)."""
        return dataclasses.replace(self, **changes)

    @property
    def num_params(self) -> int:
        """Parameters in the model."""
        attention = self.hidden * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)
        layer = attention + 3 * self.hidden * self.mlp + 2 * self.hidden
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * layer + self.hidden + head


_LLAMA3_SCALING = RopeScaling(factor=8.0, original_max_len=8192)
_LLAMA32_SCALING = RopeScaling(factor=32.0, original_max_len=8192)

CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        vocab=512,
        hidden=64,
        layers=2,
        q_heads=4,
        kv_heads=2,
        head_dim=16,
        mlp=128,
        rope_theta=10_000.0,
        max_len=256,
        bos_id=1,
        eos_ids=(2,),
    ),
    "llama-2-7b": LlamaConfig(
        vocab=32000,
        hidden=4096,
        layers=32,
        q_heads=32,
        kv_heads=32,
        head_dim=128,
        mlp=11008,
        rope_theta=10_000.0,
        norm_eps=1e-5,
        max_len=4096,
        bos_id=1,
        eos_ids=(2,),
    ),
    "llama-2-13b": LlamaConfig(
        vocab=32000,
        hidden=5120,
        layers=40,
        q_heads=40,
        kv_heads=40,
        head_dim=128,
        mlp=13824,
        rope_theta=10_000.0,
        norm_eps=1e-5,
        max_len=4096,
        bos_id=1,
        eos_ids=(2,),
    ),
    "llama-3-8b": LlamaConfig(
        vocab=128256,
        hidden=4096,
        layers=32,
        q_heads=32,
        kv_heads=8,
        head_dim=128,
        mlp=14336,
        rope_theta=500_000.0,
        rope_scaling=_LLAMA3_SCALING,
        max_len=8192,
        bos_id=128000,
        eos_ids=(128001, 128009),
    ),
    "llama-3.2-1b": LlamaConfig(
        vocab=128256,
        hidden=2048,
        layers=16,
        q_heads=32,
        kv_heads=8,
        head_dim=64,
        mlp=8192,
        rope_theta=500_000.0,
        rope_scaling=_LLAMA32_SCALING,
        tie_embeddings=True,
        max_len=131072,
        bos_id=128000,
        eos_ids=(128001, 128008, 128009),
    ),
    "llama-3.2-3b": LlamaConfig(
        vocab=128256,
        hidden=3072,
        layers=28,
        q_heads=24,
        kv_heads=8,
        head_dim=128,
        mlp=8192,
        rope_theta=500_000.0,
        rope_scaling=_LLAMA32_SCALING,
        tie_embeddings=True,
        max_len=131072,
        bos_id=128000,
        eos_ids=(128001, 128008, 128009),
    ),
}
"""The LLaMa family by name (Llama-3's vocabulary and RoPE scaling, Llama-3.2's tied
embeddings), and ``tiny`` for tests and the CPU walk-through."""


def get_config(name: str) -> LlamaConfig:
    """The config called ``name`` (a key of `CONFIGS`).

    Raises:
      pf.InvalidInputError: no config has that name (the message lists them).
    """
    if name not in CONFIGS:
        raise pf.InvalidInputError(f"config: unknown name {name!r}; known: {sorted(CONFIGS)}")
    return CONFIGS[name]


def _required(hf: dict[str, Any], key: str) -> Any:
    if key not in hf:
        raise pf.InvalidInputError(f"config.json: missing required key {key!r}")
    return hf[key]


def from_hf_config(hf: dict[str, Any]) -> LlamaConfig:
    """A `LlamaConfig` from the dict of a Hugging Face LLaMa ``config.json``.

    Raises:
      pf.InvalidInputError: a required key is missing, or the model is not a LLaMa (other
        ``model_type``s, attention biases, or a RoPE scaling type other than ``llama3``).
    """
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise pf.InvalidInputError(f"config.json: expected model_type 'llama', got {model_type!r}")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise pf.InvalidInputError("config.json: attention_bias/mlp_bias are not supported")
    hidden = _required(hf, "hidden_size")
    q_heads = _required(hf, "num_attention_heads")
    scaling = hf.get("rope_scaling")
    rope_scaling = None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise pf.InvalidInputError(
                f"config.json: rope_scaling: expected rope_type 'llama3', got {kind!r}"
            )
        rope_scaling = RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_len=int(scaling["original_max_position_embeddings"]),
        )
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return LlamaConfig(
        vocab=_required(hf, "vocab_size"),
        hidden=hidden,
        layers=_required(hf, "num_hidden_layers"),
        q_heads=q_heads,
        kv_heads=hf.get("num_key_value_heads", q_heads),
        head_dim=hf.get("head_dim") or hidden // q_heads,
        mlp=_required(hf, "intermediate_size"),
        rope_theta=float(hf.get("rope_theta", 10_000.0)),
        rope_scaling=rope_scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_len=int(hf.get("max_position_embeddings", 8192)),
        bos_id=hf.get("bos_token_id"),
        eos_ids=eos_ids,
    )


def to_hf_config(config: LlamaConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict of ``config`` (inverse of `from_hf_config`)."""
    hf: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab,
        "hidden_size": config.hidden,
        "num_hidden_layers": config.layers,
        "num_attention_heads": config.q_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.mlp,
        "hidden_act": "silu",
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_len,
        "bos_token_id": config.bos_id,
        "eos_token_id": list(config.eos_ids) if len(config.eos_ids) != 1 else config.eos_ids[0],
        "torch_dtype": "bfloat16",
    }
    if config.rope_scaling is not None:
        s = config.rope_scaling
        hf["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_len,
        }
    return hf


def load_hf_config(path: str | pathlib.Path) -> LlamaConfig:
    """`from_hf_config` of a ``config.json`` file, or of the one in a model directory."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise pf.InvalidInputError(f"model: no config.json at {path}")
    return from_hf_config(json.loads(path.read_text()))
