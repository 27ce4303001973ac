"""`flash_attention`: the forward and backward kernels joined by a custom VJP."""

from __future__ import annotations

import functools

import jax

from pallas_flash.specs import AttentionSpec, SegmentIds
from pallas_flash_pallas.backward import flash_backward
from pallas_flash_pallas.block_sizes import BlockSizes
from pallas_flash_pallas.forward import flash_forward, flash_output

_Residuals = tuple[jax.Array, jax.Array, jax.Array, SegmentIds | None, jax.Array, jax.Array]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: SegmentIds | None,
    spec: AttentionSpec,
    block_sizes: BlockSizes,
) -> jax.Array:
    """Attention of validated inputs, differentiable with respect to q, k and v.

    Args:
      q: ``[batch, q_heads, q_len, head_dim]``, bfloat16 or float32.
      k: ``[batch, kv_heads, kv_len, head_dim]``, dtype of q; ``q_heads % kv_heads == 0``.
      v: ``[batch, kv_heads, kv_len, head_dim]``, dtype of q.
      segment_ids: int32 ``q [batch, q_len]`` and ``kv [batch, kv_len]``, or None.
      spec: the call's settings.
      block_sizes: the kernels' block sizes.

    Returns:
      ``[batch, q_heads, q_len, head_dim]`` in q's dtype. Undifferentiated, the forward kernel
      skips the log-sum-exp; the backward pass saves q, k, v, the output and the log-sum-exp:
      nothing of size ``q_len x kv_len``.
    """
    return flash_output(q, k, v, segment_ids, spec=spec, block_sizes=block_sizes)


def _forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: SegmentIds | None,
    spec: AttentionSpec,
    block_sizes: BlockSizes,
) -> tuple[jax.Array, _Residuals]:
    out, lse = flash_forward(q, k, v, segment_ids, spec=spec, block_sizes=block_sizes)
    return out, (q, k, v, segment_ids, out, lse)


def _backward(
    spec: AttentionSpec, block_sizes: BlockSizes, residuals: _Residuals, dout: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    q, k, v, segment_ids, out, lse = residuals
    dq, dk, dv = flash_backward(
        q, k, v, segment_ids, out, lse, dout, spec=spec, block_sizes=block_sizes
    )
    return dq, dk, dv, None


flash_attention.defvjp(_forward, _backward)
