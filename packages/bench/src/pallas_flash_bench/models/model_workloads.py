"""Model workloads: a LLaMa train step, a serving run or a step of the serving engine on a v5e
slice, and the published figures each is held against.

The references are measured on hardware by their authors; ours are static estimates (see
`whole_program`): the report labels both.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pallas_flash_bench.kernels import ragged_step
from pallas_flash_bench.kernels.sweeps import RAGGED_MIXES, SERVING_LENGTHS
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_bench.models import maxtext_steps
from pallas_flash_llama.config import LlamaConfig, get_config
from pallas_flash_llama.engine_step import bucket_for, token_buckets

_16B = maxtext_steps.STEPS["16b"]
MAXTEXT_16B = LlamaConfig(
    **{f: getattr(_16B, f) for f in maxtext_steps.SHAPE_FIELDS},
    rope_theta=10_000.0,
    max_len=_16B.seq_len,
)
"""MaxText's default decoder at ``global_parameter_scale=16`` (base.yml: emb 2048, 16 heads
of 128, MLP 7168, 16 layers, vocabulary 32,000; the scale doubles the width, quadruples the
heads and MLP and doubles the layers): 15.8 B parameters, a LLaMa layer (RMSNorm, RoPE,
SwiGLU) without GQA."""

MODELS = {"maxtext-16b": MAXTEXT_16B}
"""Shapes the bench adds to `pallas_flash_llama.config.CONFIGS`."""


def model_config(name: str) -> LlamaConfig:
    return MODELS[name] if name in MODELS else get_config(name)


@dataclasses.dataclass(frozen=True)
class Reference:
    """A published figure: ``value`` in ``unit`` (``mfu`` as a fraction, or ``tokens/s``)."""

    source: str
    value: float
    unit: Literal["mfu", "tokens/s"]
    note: str = ""


@dataclasses.dataclass(frozen=True)
class ModelWorkload:
    """One model program on one slice.

    ``step="train"``: a training step (forward, backward, AdamW) on ``batch`` sequences of
    ``seq_len`` tokens, float32 master weights, the mesh ``(data, fsdp, tensor)``.
    ``step="serve"``: ``batch`` prompts of ``prompt_len`` tokens prefilled ``prefill_batch``
    at a time (as JetStream's engine prefills requests and inserts them into the decode
    batch), then ``generate_len`` decode steps of the whole batch against a contiguous cache
    of ``prompt_len + generate_len`` positions (``kv_dtype``: None for the compute dtype, or
    ``int8``; ``weights``: ``int8`` for int8 matmul weights, `pallas_flash_llama.int8_weights`),
    split over the mesh as ``cache_split`` says (`pallas_flash_llama.kv_cache`:
    ``heads``, each chip its kv heads of every sequence; ``sequence``, each chip a share of
    every sequence's positions, the partials merged across chips).

    ``step="engine"``: one step of the serving engine (`pallas_flash_llama.engine_step`),
    tensor-parallel, its paged cache (pages of ``page_size``) split over kv heads, its
    attention ``decode_backend``'s ragged kernel: with ``mix`` None, the steady state of a
    run of ``batch`` slots serving prompts of ``prompt_len`` and ``generate_len`` new tokens
    each (`engine_mix`), the first ``cached_prefix`` tokens of every prompt shared and found
    in the prefix cache; else the mixed step ``mix`` of `RAGGED_MIXES` (vLLM's). The step is
    compiled at the engine's token bucket for its tokens (`token_buckets` of
    ``token_budget``; a steady-state row's budget is its step's tokens, `ENGINE`).

    The ablation's switches: ``dtype`` (compute), ``scan_layers``, ``backend``, ``remat``,
    ``donate``. ``loss_chunk``: the training loss's logits made this many positions at a
    time (`pallas_flash_llama.loss`).
    """

    name: str
    step: Literal["train", "serve", "engine"]
    model: str
    target: str
    mesh: tuple[int, int, int]
    batch: int
    seq_len: int = 2048
    remat: str = "none"
    backend: str = "pallas"
    dtype: str = "bfloat16"
    scan_layers: bool = True
    donate: bool = True
    prompt_len: int = 1024
    generate_len: int = 1024
    kv_dtype: str | None = None
    decode_backend: str = "splitkv"
    prefill_batch: int = 8
    cache_split: str = "heads"
    loss_chunk: int | None = None
    mix: str | None = None
    token_budget: int = 512
    page_size: int = 128
    cached_prefix: int = 0
    weights: str | None = None

    @property
    def prefill_calls(self) -> int:
        """Prefill steps a serving run takes: its batch, ``prefill_batch`` prompts each."""
        return -(-self.batch // self.prefill_batch)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh", tuple(self.mesh))  # from JSON: a list

    @property
    def mean_length(self) -> int:
        """Serving: the cached positions a decode step attends to on average over the run,
        ``prompt_len + (generate_len + 1) / 2`` rounded down (step ``t`` attends to
        ``prompt_len + t``, for ``t`` from 1 to ``generate_len``)."""
        return self.prompt_len + (self.generate_len + 1) // 2

    @property
    def config(self) -> LlamaConfig:
        base = model_config(self.model)
        return base.replace(remat=self.remat, dtype=self.dtype, scan_layers=self.scan_layers,
                            loss_chunk=self.loss_chunk)  # fmt: skip

    @property
    def chips(self) -> int:
        data, fsdp, tensor = self.mesh
        return data * fsdp * tensor

    @property
    def tokens(self) -> int:
        """Tokens a step trains on, a serving run generates, or an engine step samples (one
        per decoding sequence)."""
        if self.step == "engine":
            return self.engine_mix().batch
        return self.batch * (self.seq_len if self.step == "train" else self.generate_len)

    def engine_mix(self, tensor: int = 1) -> Workload:
        """An engine step's attention (a ragged `Workload`, ``ragged_step``) with ``1 /
        tensor`` of the heads, one chip's share. The steady state of the run (``mix`` None):
        ``batch - 1`` sequences decode, their lengths spread over those the run reaches
        (``prompt_len + 1`` to ``prompt_len + generate_len``), beside one prompt prefilled in
        chunks of ``(batch - 1) * prompt_len / generate_len`` tokens (requests then start as
        fast as they end), its chunk at the prompt's middle on average."""
        c = self.config
        heads = dict(q_heads=c.q_heads // tensor, kv_heads=c.kv_heads // tensor,
                     head_dim=c.head_dim, cache="paged", page_size=self.page_size)  # fmt: skip
        if self.mix is not None:
            return Workload("ragged", SERVING_LENGTHS[1], lengths=SERVING_LENGTHS, **heads,
                            **RAGGED_MIXES[self.mix])  # fmt: skip
        decodes, computed = self.batch - 1, self.prompt_len - self.cached_prefix
        chunk = max(round(decodes * computed / self.generate_len), 1)
        max_len = self.prompt_len + self.generate_len
        return Workload("ragged", max_len, batch=decodes, lengths=(self.prompt_len + 1, max_len),
                        even_lengths=True, prefill=(1, chunk),
                        prefill_context=self.cached_prefix + (computed - chunk) // 2,
                        **heads)  # fmt: skip

    @property
    def engine_bucket(self) -> int:
        """The token bucket an engine step is compiled at: the smallest that holds its
        tokens."""
        return bucket_for(ragged_step.tokens(self.engine_mix()), token_buckets(self.token_budget))

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _train(name: str, model: str, target: str, chips: int, per_chip: int, remat: str,
           **kw) -> ModelWorkload:  # fmt: skip
    return ModelWorkload(name, "train", model, target, (1, chips, 1), per_chip * chips,
                         remat=remat, **kw)  # fmt: skip


def _serve(name: str, model: str, batch: int, **kw) -> ModelWorkload:
    return ModelWorkload(name, "serve", model, "v5e-8", (1, 1, 8), batch, **kw)


def _engine(name: str, model: str, batch: int, **kw) -> ModelWorkload:
    return ModelWorkload(name, "engine", model, "v5e-8", (1, 1, 8), batch, **kw)


def _steady(name: str, model: str, batch: int, **kw) -> ModelWorkload:
    """A steady-state engine row whose token budget is its step's tokens: the budget at which
    the engine's scheduler, filling each step with the decodes and then a prompt chunk, makes
    that step (and compiles it unpadded)."""
    row = _engine(name, model, batch, **kw)
    return dataclasses.replace(row, token_budget=ragged_step.tokens(row.engine_mix()))


SHARED_PREFIX = {"model": "llama-3-8b", "batch": 128, "prompt_len": 1152, "generate_len": 128}
"""The shared-prefix rows' run (`ENGINE`)."""

TRAINING = [
    _train("train maxtext-16b", "maxtext-16b", "v5e-256", 256, 6, "full"),
    _train("train llama-2-7b", "llama-2-7b", "v5e-256", 256, 4, "save_qkv"),
    _train("train llama-3.2-1b", "llama-3.2-1b", "v5e-4", 4, 4, "save_qkv", loss_chunk=256),
]
SERVING = [
    _serve("serve llama-2-7b bf16", "llama-2-7b", 96),
    _serve("serve llama-2-7b int8", "llama-2-7b", 96, kv_dtype="int8"),
    # int8 weights too, as the jetstream-pytorch measurement quantizes them
    _serve("serve llama-2-7b int8 weights", "llama-2-7b", 96, kv_dtype="int8", weights="int8"),
    _serve("serve llama-3-8b bf16", "llama-3-8b", 128),
    # JetStream-MaxText's recipe: 11 sequences a chip, bfloat16 weights and cache, one
    # prompt a prefill
    _serve("serve llama-2-7b, maxtext settings", "llama-2-7b", 88, prefill_batch=1),
]

ENGINE = [
    # the serving rows' runs, steady state: prompts of 1024 and 1024 new tokens each
    _steady("engine llama-2-7b, maxtext settings", "llama-2-7b", 88),
    _steady("engine llama-2-7b bf16", "llama-2-7b", 96),
    _steady("engine llama-3-8b bf16", "llama-3-8b", 128),
    _steady("engine llama-2-7b int8 weights", "llama-2-7b", 96, kv_dtype="int8", weights="int8"),
    # vLLM's mixed steps at its token budgets on TPU
    _engine("engine llama-3-8b vllm-512", "llama-3-8b", 65, mix="vllm-512"),
    _engine("engine llama-3-8b vllm-2048", "llama-3-8b", 131, mix="vllm-2048", token_budget=2048),
    # prompts sharing a 1024-token prefix (a system prompt) before 128 tokens of their own,
    # as vLLM's prefix-caching benchmark sizes them; 128 new tokens each
    _steady("engine llama-3-8b shared prefix, cached", **SHARED_PREFIX, cached_prefix=1024),
    _steady("engine llama-3-8b shared prefix, no caching", **SHARED_PREFIX),
]
"""Steps of the serving engine (`pallas_flash_llama.engine_step`) on v5e-8, tensor-parallel:
the steady state of the serving rows' runs, vLLM's mixed steps, and a run of prompts sharing
a prefix with the prefix cache and without."""

REFERENCES = {
    "train maxtext-16b": Reference(
        "MaxText README (v5e-256, measured)", 0.611, "mfu", "120 TFLOP/s/chip"
    ),
    "serve llama-2-7b bf16": Reference("jetstream-pytorch (v5e-8, measured)", 3663, "tokens/s"),
    "serve llama-2-7b int8": Reference("jetstream-pytorch (v5e-8, measured)", 4783, "tokens/s"),
    "serve llama-3-8b bf16": Reference("jetstream-pytorch (v5e-8, measured)", 8249, "tokens/s"),
    "serve llama-2-7b, maxtext settings": Reference(
        "JetStream-MaxText (v5e-8, measured)",
        3061.78,
        "tokens/s",
        "tpu-recipes inference/v5e/JetStream-Maxtext/Llama2-7B: bfloat16 weights and cache, "
        "openorca prompts (218 tokens in, 940 out on average)",
    ),
}
REFERENCES["serve llama-2-7b int8 weights"] = REFERENCES["serve llama-2-7b int8"]
for _served in ("llama-2-7b, maxtext settings", "llama-2-7b bf16", "llama-3-8b bf16",
                "llama-2-7b int8 weights"):  # fmt: skip
    REFERENCES[f"engine {_served}"] = REFERENCES[f"serve {_served}"]
"""Published figures by workload name; MaxText ships the Llama-2-7B config without one. An
engine row's run is its serving row's, held against the same measurement."""


def ablation() -> list[tuple[str, ModelWorkload]]:
    """The ablation (Llama-2-7B training on v5e-256, 4 sequences of 2048 per chip): each row
    adds one change to the row before, ``(what changed, workload)``."""
    row = ModelWorkload("ablation", "train", "llama-2-7b", "v5e-256", (256, 1, 1), 1024,
                        backend="xla", dtype="float32", scan_layers=False,
                        donate=False)  # fmt: skip
    steps = [
        ("float32 compute, a Python loop over layers, XLA attention, data parallel", {}),
        ("bfloat16 compute", {"dtype": "bfloat16"}),
        ("lax.scan over layers", {"scan_layers": True}),
        ("Pallas flash attention (xla -> pallas)", {"backend": "pallas"}),
        ("remat, saving q, k, v", {"remat": "save_qkv"}),
        ("donated state", {"donate": True}),
        ("FSDP: parameters and optimiser state sharded over the 256 chips", {"mesh": (1, 256, 1)}),
    ]
    out = []
    for i, (what, change) in enumerate(steps):
        row = dataclasses.replace(row, name=f"ablation {i}", **change)
        same = [w for w in TRAINING if w == dataclasses.replace(row, name=w.name)]
        out.append((what, same[0] if same else row))  # the last row is the training row's
    return out


ABLATION_DECODE = [
    ("serving, bfloat16 cache split along the sequence (Split-KV across chips)",
     dataclasses.replace(SERVING[0], name="ablation decode 0", cache_split="sequence")),
    ("cache split over kv heads (no merge across chips)", SERVING[0]),
    ("int8 KV cache", SERVING[1]),
]  # fmt: skip
"""The serving end of the ablation: the decode step with the cache split along the sequence,
then over kv heads, then in int8."""


def ablation_steps() -> list[tuple[str, str]]:
    """The ablation's rows in order, ``(what the row changes, workload name)``: training, then
    serving (results.json's ``ablation``, which the report's table follows)."""
    return [(what, w.name) for what, w in [*ablation(), *ABLATION_DECODE]]


def default_models() -> list[ModelWorkload]:
    """Every model workload: the training and serving rows, then the ablation's."""
    rows = [*TRAINING, *SERVING, *(w for _, w in ablation()), *(w for _, w in ABLATION_DECODE)]
    return list({w.name: w for w in rows}.values())


def engine_models() -> list[ModelWorkload]:
    """The serving engine's steps (`ENGINE`): the serving sweep's model rows."""
    return list(ENGINE)


def quick_models() -> list[ModelWorkload]:
    """The quick sweep's one small model row (a CI-sized run exercises the whole path)."""
    return [TRAINING[2]]
