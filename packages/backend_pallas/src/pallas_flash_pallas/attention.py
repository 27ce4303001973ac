"""`flash_attention`: the forward and backward kernels joined by a custom VJP."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_flash.specs import AttentionSpec, SegmentIds
from pallas_flash_pallas.backward import flash_backward
from pallas_flash_pallas.block_sizes import BlockSizes
from pallas_flash_pallas.forward import flash_forward, flash_output

_Residuals = tuple[
    jax.Array, jax.Array, jax.Array, SegmentIds | None, jax.Array | None, jax.Array, jax.Array
]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: SegmentIds | None,
    sinks: jax.Array | None,
    spec: AttentionSpec,
    block_sizes: BlockSizes,
) -> jax.Array:
    """Attention of validated inputs, differentiable with respect to q, k, v and sinks.

    Args:
      q: ``[batch, q_heads, q_len, head_dim]``, bfloat16 or float32.
      k: ``[batch, kv_heads, kv_len, head_dim]``, dtype of q; ``q_heads % kv_heads == 0``.
      v: ``[batch, kv_heads, kv_len, head_dim]``, dtype of q.
      segment_ids: int32 ``q [batch, q_len]`` and ``kv [batch, kv_len]``, or None.
      sinks: ``[q_heads]`` float, a logit per query head in every row's denominator, or None.
      spec: the call's settings.
      block_sizes: the kernels' block sizes.

    Returns:
      ``[batch, q_heads, q_len, head_dim]`` in q's dtype. Undifferentiated, the forward kernel
      skips the log-sum-exp; the backward pass saves q, k, v, the output and the log-sum-exp:
      nothing of size ``q_len x kv_len``.
    """
    return flash_output(q, k, v, segment_ids, sinks, spec=spec, block_sizes=block_sizes)


def _forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: SegmentIds | None,
    sinks: jax.Array | None,
    spec: AttentionSpec,
    block_sizes: BlockSizes,
) -> tuple[jax.Array, _Residuals]:
    out, lse = flash_forward(q, k, v, segment_ids, sinks, spec=spec, block_sizes=block_sizes)
    return out, (q, k, v, segment_ids, sinks, out, lse)


def _backward(
    spec: AttentionSpec, block_sizes: BlockSizes, residuals: _Residuals, dout: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, None, jax.Array | None]:
    q, k, v, segment_ids, sinks, out, lse = residuals
    dq, dk, dv = flash_backward(
        q, k, v, segment_ids, out, lse, dout, spec=spec, block_sizes=block_sizes
    )
    dsinks = None if sinks is None else sinks_gradient(sinks, out, lse, dout)
    return dq, dk, dv, None, dsinks


def sinks_gradient(sinks: jax.Array, out: jax.Array, lse: jax.Array, dout: jax.Array) -> jax.Array:
    """The sinks' gradient ``[q_heads]``, in their dtype, summed in float32.

    A row's sink takes the weight ``p = exp(sink - lse)`` of its softmax and has no value,
    so its logit's gradient is ``-p (dout . out)``, summed over the batch and the rows.
    ``out`` and ``dout``: ``[batch, q_heads, q_len, head_dim]``; ``lse [batch, q_heads, 1,
    q_len]`` float32 (sink included; ``-inf`` for a row with neither key nor sink)."""
    delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
    sink = sinks.astype(jnp.float32)[None, :, None, None]
    weight = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(sink - lse))  # lse in its own layout
    return -jnp.sum(weight * delta[:, :, None, :], axis=(0, 2, 3)).astype(sinks.dtype)


flash_attention.defvjp(_forward, _backward)
