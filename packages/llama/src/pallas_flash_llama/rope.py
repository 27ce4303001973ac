"""Rotary position embeddings (RoPE) with Llama-3 frequency scaling, in float32.

The rotation pairs dimension ``i`` with ``i + head_dim / 2`` (Hugging Face's ``rotate_half``
layout), so Hugging Face checkpoints load without permuting their q/k projections.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash_llama.config import LlamaConfig, RopeScaling


def frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """The ``[head_dim / 2]`` float64 angular frequencies, Llama-3-scaled when ``scaling``."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return freqs
    wavelen = 2 * math.pi / freqs
    low_wavelen = scaling.original_max_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_len / scaling.high_freq_factor
    smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    between = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    return np.where(
        wavelen < high_wavelen,
        freqs,
        np.where(wavelen > low_wavelen, freqs / scaling.factor, between),
    )


def apply_rope(x: jax.Array, positions: jax.Array, config: LlamaConfig) -> jax.Array:
    """``x`` rotated by its positions' angles, in x's dtype (angles and rotation in float32).

    Args:
      x: ``[batch, heads, seq, head_dim]``.
      positions: ``[batch, seq]`` int32 position of each token.
    """
    freqs = jnp.asarray(frequencies(config.head_dim, config.rope_theta, config.rope_scaling))
    angles = positions[:, None, :, None].astype(jnp.float32) * freqs.astype(jnp.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
