"""Exact merges of partial attention results by their log-sum-exps.

A partial result over a subset of the keys is its normalised output ``o_i`` and log-sum-exp
``lse_i`` (the log of its softmax denominator). Over the union, ``lse = log sum_i exp(lse_i)``
and ``o = sum_i exp(lse_i - lse) o_i``. Both are computed relative to ``m = max_i lse_i`` so
nothing overflows; a part that saw no key has ``lse_i = -inf`` and weight exactly 0, and when
no part saw a key the result is output 0 and log-sum-exp ``-inf`` (never NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _weights(lse: jax.Array, top: jax.Array) -> jax.Array:
    """``exp(lse - top)``, 0 where ``lse`` is ``-inf`` (``top`` too, then)."""
    return jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - jnp.where(top == -jnp.inf, 0.0, top)))


def _result(total_out: jax.Array, total: jax.Array, top: jax.Array) -> tuple[jax.Array, jax.Array]:
    seen = total > 0.0
    out = total_out / jnp.where(seen, total, 1.0)[..., None]
    lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return out, lse


def merge(out: jax.Array, lse: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """Merges the parts along ``axis``.

    Args:
      out: partial outputs ``[..., parts, ..., head_dim]`` float32, ``parts`` at ``axis``.
      lse: their log-sum-exps, ``out``'s shape without ``head_dim``.
      axis: the parts' axis (non-negative, before ``head_dim``).

    Returns:
      ``(out, lse)`` without the parts' axis.
    """
    top = jnp.max(lse, axis=axis, keepdims=True)
    weights = _weights(lse, top)
    total_out = jnp.sum(weights[..., None] * out, axis=axis)
    return _result(total_out, jnp.sum(weights, axis=axis), jnp.squeeze(top, axis))


def merge_across(
    out: jax.Array, lse: jax.Array, axis_name: str | tuple[str, ...]
) -> tuple[jax.Array, jax.Array]:
    """Merges each device's part over the mesh axes ``axis_name`` (inside ``shard_map``).

    Only ``lse``-sized and ``out``-sized values cross the interconnect: one ``pmax`` of the
    log-sum-exps and one ``psum`` of the weighted outputs and weights.

    Args:
      out: this device's partial output ``[..., head_dim]`` float32.
      lse: its log-sum-exp, ``out``'s shape without ``head_dim``.
      axis_name: the mesh axes the parts are spread over.

    Returns:
      ``(out, lse)``, the same on every device.
    """
    top = jax.lax.pmax(lse, axis_name)
    weights = _weights(lse, top)
    total_out, total = jax.lax.psum((weights[..., None] * out, weights), axis_name)
    return _result(total_out, total, top)
