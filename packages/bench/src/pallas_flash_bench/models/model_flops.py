"""Model flops: the work a LLaMa step must do, counted the way MaxText counts it for MFU.

MaxText (``calculate_tflops_training_per_device``) counts the matmuls only, forward and
backward (three times the forward):

- weights: ``2 x tokens x`` the matmul weights each token meets, per layer the q, k, v and
  output projections and the SwiGLU MLP's three matrices, plus the output (logits)
  projection once; the input embedding is a lookup, not a matmul, and is not counted. This is
  the usual ``6 x params x tokens`` with the input embedding left out of ``params``;
- attention: ``4 x batch x seq^2 x q_heads x head_dim`` per layer forward (scores and
  values), halved for a causal mask, as MaxText now does.

Decoding one token per sequence against a cache of ``length`` positions: ``2 x`` the matmul
weights plus ``4 x length x q_heads x head_dim`` per layer, per sequence (forward only). An
engine step: ``2 x`` the matmul weights per new token (its padding not counted), plus the
attention over the (query, key) pairs its causal mask lets through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pallas_flash_bench.kernels import ragged_step

if TYPE_CHECKING:
    from pallas_flash_bench.kernels.workloads import Workload
    from pallas_flash_llama.config import LlamaConfig


def matmul_weights(config: LlamaConfig) -> int:
    """Weights a token meets in matmuls: every layer's projections and MLP, and the logits'
    projection (the embedding's transpose when tied); the input lookup is not counted."""
    c = config
    attention = c.hidden * c.head_dim * (2 * c.q_heads + 2 * c.kv_heads)
    layer = attention + 3 * c.hidden * c.mlp
    return c.layers * layer + c.hidden * c.vocab


def attention_flops(config: LlamaConfig, batch: int, seq_len: int, causal: bool = True) -> float:
    """Forward flops of every layer's attention over ``batch`` sequences of ``seq_len``."""
    c = config
    flops = 4.0 * batch * seq_len * seq_len * c.q_heads * c.head_dim * c.layers
    return flops / 2 if causal else flops


def train_step_flops(
    config: LlamaConfig, batch: int, seq_len: int, causal_halved: bool = True
) -> float:
    """Flops of one training step (forward and backward) on ``batch x seq_len`` tokens;
    ``causal_halved=False``: MaxText's count before it halved causal attention."""
    tokens = batch * seq_len
    attention = attention_flops(config, batch, seq_len, causal=causal_halved)
    return 3 * (2.0 * matmul_weights(config) * tokens + attention)


def decode_step_flops(config: LlamaConfig, batch: int, length: int) -> float:
    """Flops of one decode step: one new token for each of ``batch`` sequences whose caches
    hold ``length`` positions."""
    c = config
    per_sequence = 2.0 * matmul_weights(config) + 4.0 * length * c.q_heads * c.head_dim * c.layers
    return batch * per_sequence


def engine_step_flops(config: LlamaConfig, step: Workload) -> float:
    """Flops of one serving-engine step whose attention is ``step`` (a ragged `Workload` with
    every head, `ModelWorkload.engine_mix`)."""
    tokens = ragged_step.tokens(step)
    return 2.0 * matmul_weights(config) * tokens + ragged_step.useful_flops(step) * config.layers
