"""Score transforms every backend applies the same way: soft-capping and positional masks.

The functions work on any broadcastable index arrays, so a dense backend passes whole
``[q_len, 1]`` / ``[1, kv_len]`` position vectors and a tiled kernel passes one block's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash.specs import AttentionSpec


def apply_softcap(scores: jax.Array, softcap: float | None) -> jax.Array:
    """Returns ``softcap * tanh(scores / softcap)``, or ``scores`` when ``softcap`` is None."""
    if softcap is None:
        return scores
    return softcap * jnp.tanh(scores / softcap)


def positional_mask(q_pos: jax.Array, kv_pos: jax.Array, spec: AttentionSpec) -> jax.Array | None:
    """Which keys each query may see under the spec's causal and sliding-window rules.

    Args:
      q_pos: query row indices (``0..q_len-1``), any shape broadcastable against ``kv_pos``.
      kv_pos: key indices.
      spec: supplies ``q_offset``, ``causal`` and ``window``.

    Returns:
      A boolean array of the broadcast shape, True where the key is visible, or None when the
      spec has no positional rule (every key visible).
    """
    if not spec.causal and spec.window is None:
        return None
    pos = q_pos + spec.q_offset
    visible = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(kv_pos)), dtype=bool)
    if spec.causal:
        visible = visible & (kv_pos <= pos)
    if spec.window is not None:
        left, right = spec.window
        visible = visible & (kv_pos >= pos - left) & (kv_pos <= pos + right)
    return visible
