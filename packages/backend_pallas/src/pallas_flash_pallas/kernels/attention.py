"""`flash_attention`: the forward and backward kernels joined by a custom VJP."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal

from pallas_flash.specs import AttentionSpec, SegmentIds
from pallas_flash_pallas.blocks.block_sizes import BlockSizes
from pallas_flash_pallas.kernels.backward import flash_backward
from pallas_flash_pallas.kernels.forward import flash_forward, flash_output


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q", "k", "v", "segment_ids", "sinks", "bias", "out", "lse"],
    meta_fields=["with_bias_gradient"],
)
@dataclasses.dataclass(frozen=True)
class _Residuals:
    """What the backward pass reads: the inputs, the output and the log-sum-exp; and whether
    the bias takes a gradient (it is perturbed: differentiated, not a constant)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    segment_ids: SegmentIds | None
    sinks: jax.Array | None
    bias: jax.Array | None
    out: jax.Array
    lse: jax.Array
    with_bias_gradient: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: SegmentIds | None,
    sinks: jax.Array | None,
    bias: jax.Array | None,
    spec: AttentionSpec,
    block_sizes: BlockSizes,
) -> jax.Array:
    """Attention of validated inputs, differentiable with respect to q, k, v, sinks and bias.

    Args:
      q: ``[batch, q_heads, q_len, head_dim]``, bfloat16 or float32.
      k: ``[batch, kv_heads, kv_len, head_dim]``, dtype of q; ``q_heads % kv_heads == 0``.
      v: ``[batch, kv_heads, kv_len, head_dim]``, dtype of q.
      segment_ids: int32 ``q [batch, q_len]`` and ``kv [batch, kv_len]``, or None.
      sinks: ``[q_heads]`` float, a logit per query head in every row's denominator, or None.
      bias: ``[batch or 1, q_heads or 1, q_len, kv_len]`` float, added to the scores, or None.
      spec: the call's settings.
      block_sizes: the kernels' block sizes.

    Returns:
      ``[batch, q_heads, q_len, head_dim]`` in q's dtype. Undifferentiated, the forward kernel
      skips the log-sum-exp; the backward pass saves q, k, v, the output and the log-sum-exp:
      nothing of size ``q_len x kv_len`` but the bias itself. The bias's gradient is computed
      only when the bias is differentiated (a float32 ``[batch, q_heads, q_len, kv_len]``
      before it is summed to the bias's shape).
    """
    return flash_output(q, k, v, segment_ids, sinks, bias, spec=spec, block_sizes=block_sizes)


def _forward(
    q: CustomVJPPrimal,
    k: CustomVJPPrimal,
    v: CustomVJPPrimal,
    segment_ids: SegmentIds | None,
    sinks: CustomVJPPrimal | None,
    bias: CustomVJPPrimal | None,
    spec: AttentionSpec,
    block_sizes: BlockSizes,
) -> tuple[jax.Array, _Residuals]:
    """The forward with every differentiable argument as a `CustomVJPPrimal` (value and
    whether it is perturbed: ``symbolic_zeros``)."""
    with_bias_gradient = bias is not None and bias.perturbed
    q, k, v, segment_ids, sinks, bias = jax.tree.map(
        lambda x: x.value,
        (q, k, v, segment_ids, sinks, bias),
        is_leaf=lambda x: isinstance(x, CustomVJPPrimal),
    )
    out, lse = flash_forward(q, k, v, segment_ids, sinks, bias, spec=spec, block_sizes=block_sizes)
    return out, _Residuals(q, k, v, segment_ids, sinks, bias, out, lse, with_bias_gradient)


def _backward(
    spec: AttentionSpec, block_sizes: BlockSizes, res: _Residuals, dout: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, None, jax.Array | None, jax.Array | None]:
    dq, dk, dv, dbias = flash_backward(
        res.q, res.k, res.v, res.segment_ids, res.out, res.lse, dout, spec=spec,
        block_sizes=block_sizes, bias=res.bias, with_bias_gradient=res.with_bias_gradient,
    )  # fmt: skip
    dsinks = None if res.sinks is None else sinks_gradient(res.sinks, res.out, res.lse, dout)
    return dq, dk, dv, None, dsinks, dbias


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


flash_attention.defvjp(_forward, _backward, symbolic_zeros=True)
