"""Symmetric int8 quantization of K/V rows, one float32 scale per row.

A row is one token's ``head_dim`` values of one kv head: ``scale = max|x| / 127`` and
``q = round(x / scale)``, so every row uses the full int8 range whatever its magnitude and an
outlier costs precision only in its own row. The rounding error of a value is at most
``scale / 2``, i.e. 0.4% of its row's largest magnitude. A row of zeros has scale 0 (and
dequantizes to zeros).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

INT8_MAX = 127


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Quantizes ``x [..., head_dim]`` (any float dtype) row by row.

    Returns:
      ``(values, scales)``: int8 ``[..., head_dim]`` and float32 ``[...]``.
    """
    x = jnp.asarray(x, jnp.float32)
    scales = jnp.max(jnp.abs(x), axis=-1) / INT8_MAX
    safe = jnp.where(scales > 0, scales, 1.0)[..., None]
    values = jnp.clip(jnp.round(x / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return values, scales


def dequantize_int8(values: jax.Array, scales: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``values * scales[..., None]`` in ``dtype``: the inverse of `quantize_int8`."""
    return (values.astype(jnp.float32) * scales[..., None]).astype(dtype)
