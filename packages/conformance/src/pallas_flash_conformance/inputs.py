"""Deterministic random inputs for the suite's tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def normal(
    seed: int, shape: tuple[int, ...], dtype: str = "float32", scale: float = 1.0
) -> jax.Array:
    """Standard-normal values times ``scale``, as a jax array of ``dtype``."""
    values = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(values, dtype=DTYPES[dtype])


def qkv(
    batch: int,
    q_heads: int,
    kv_heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    dtype: str = "float32",
    seed: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q ``[batch, q_heads, q_len, head_dim]``, k and v ``[batch, kv_heads, kv_len, head_dim]``."""
    return (
        normal(seed, (batch, q_heads, q_len, head_dim), dtype),
        normal(seed + 1, (batch, kv_heads, kv_len, head_dim), dtype),
        normal(seed + 2, (batch, kv_heads, kv_len, head_dim), dtype),
    )


def segment_ids(seed: int, batch: int, length: int, segments: int) -> np.ndarray:
    """``[batch, length]`` int32 ids of ``segments`` contiguous packed sequences per row."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch, length), dtype=np.int32)
    for row in ids:
        starts = np.sort(
            rng.choice(np.arange(1, length), size=min(segments, length) - 1, replace=False)
        )
        for start in starts:
            row[start:] += 1
    return ids
