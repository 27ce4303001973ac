"""The programs whose v5e times were published (`calibration_points`), as those sources ran
them, to be compiled and estimated like any program (`pallas_flash_estimate.estimate_program`).

- `guide_matmul`: the blocked matmul kernel of jax's Pallas TPU matmul guide (bf16 inputs, a
  float32 accumulator in VMEM, the output cast on the last k step), with the guide's two
  variants: the right-hand side given transposed, and an activation fused before the cast.
- `xla_matmul`, `masked_matmul`: the guides' XLA references, ``x @ y`` and ``mask * (x @ y)``.
- `tokamax_ragged_dot`: tokamax's Mosaic TPU grouped matmul at one block configuration of its
  autotuning data; `xla_ragged_dot`: ``jax.lax.ragged_dot``, XLA's.
- `tokamax_flash_attention`: tokamax's Mosaic TPU flash attention forward at one configuration
  of its autotuning data; `pallas_attention`: ours (`pf.attention` on the ``pallas``
  backend), held beside it (`tokamax_comparison`).
- `tokamax_flash_attention_vjp`: that kernel's backward from the forward's residuals;
  `pallas_attention_backward`: ours from the same residuals.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

ACTIVATIONS = {"identity": lambda x: x, "relu": jax.nn.relu}
"""The guide's fused activations, by name."""


def _guide_matmul_kernel(x_ref, y_ref, z_ref, acc_ref, *, nsteps: int, transpose_rhs: bool,
                         activation: str) -> None:  # fmt: skip
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))
    acc_ref[...] += jax.lax.dot_general(
        x_ref[...], y_ref[...], (contract, ((), ())), preferred_element_type=jnp.float32
    )

    @pl.when(pl.program_id(2) == nsteps - 1)
    def _():
        z_ref[...] = ACTIVATIONS[activation](acc_ref[...]).astype(z_ref.dtype)


def guide_matmul(
    x: jax.Array,
    y: jax.Array,
    *,
    bm: int,
    bk: int,
    bn: int,
    transpose_rhs: bool = False,
    activation: str = "identity",
) -> jax.Array:
    """``activation(x @ y)``: x ``[m, k]``, y ``[k, n]`` (``[n, k]`` with ``transpose_rhs``),
    on a ``(m / bm, n / bn, k / bk)`` grid, the guide's kernel."""
    m, k = x.shape
    n = y.shape[0] if transpose_rhs else y.shape[1]
    if transpose_rhs:
        y_spec = pl.BlockSpec((bn, bk), lambda i, j, kk: (j, kk))
    else:
        y_spec = pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))
    kernel = functools.partial(_guide_matmul_kernel, nsteps=k // bk, transpose_rhs=transpose_rhs,
                               activation=activation)  # fmt: skip
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)), y_spec],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
            grid=(m // bm, n // bn, k // bk),
        ),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
    )(x, y)


def xla_matmul(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x @ y`` by XLA."""
    return jnp.matmul(x, y)


def masked_matmul(mask: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    """``mask * (x @ y)`` by XLA (the sparse guide's reference)."""
    return mask * (x @ y)


def tokamax_ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tile_m: int,
    tile_k: int,
    tile_n: int,
    input_buffer_count: int = 2,
) -> jax.Array:
    """tokamax's Mosaic TPU ``ragged_dot`` (lhs ``[m, k]``, rhs ``[groups, k, n]``) at one
    block configuration. Needs tokamax (the bench's ``tokamax`` extra)."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu

    config = pallas_mosaic_tpu.Config(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n,
                                      input_buffer_count=input_buffer_count)  # fmt: skip
    op = pallas_mosaic_tpu.PallasMosaicTpuRaggedDot(config=config)
    return op(lhs, rhs, group_sizes=group_sizes)


def xla_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot``: XLA's grouped matmul."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def tokamax_flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    config: str,
    causal: bool = False,
    residuals: bool = False,
) -> jax.Array | tuple[jax.Array, ...]:
    """tokamax's Mosaic TPU flash attention forward: q ``[batch, seq, heads, head_dim]``, k
    and v ``[batch, seq_kv, kv_heads, head_dim]``, the scale ``1 / sqrt(head_dim)``, at the
    configuration ``config`` (its autotuning data's JSON); with ``residuals`` the softmax
    residuals are returned too. Needs tokamax (the bench's ``tokamax`` extra)."""
    from tokamax._src.ops.attention import pallas_mosaic_tpu as tpu

    fields = json.loads(config)
    for name in ("q_layout", "k_layout", "v_layout"):
        if name in fields:
            fields[name] = tpu.splash.QKVLayout(fields[name])
    op = tpu.PallasMosaicTpuFlashAttention(config=tpu.Config(**fields))
    return op(q, k, v, is_causal=causal, return_residuals=residuals)


def tokamax_flash_attention_vjp(
    max_logits: jax.Array,
    logsumexp: jax.Array,
    out: jax.Array,
    dout: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    config: str,
    causal: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tokamax's Mosaic TPU flash attention backward (its VJP op): the gradients of q, k and
    v (``[batch, seq, heads, head_dim]``, as `tokamax_flash_attention`) from the forward's
    residuals (``[batch, heads, seq]`` float32: the rows' max logits and log-sum-exp), its
    output and the output's cotangent ``dout``, at the configuration ``config`` (its
    autotuning data's JSON). Needs tokamax."""
    from tokamax._src.ops.attention import base
    from tokamax._src.ops.attention import pallas_mosaic_tpu_vjp as tpu_vjp

    op = tpu_vjp.PallasMosaicTpuFlashAttentionVjp(config=tpu_vjp.Config(**json.loads(config)))
    grads = op((max_logits, logsumexp), out, dout, q, k, v,
               precision=(jax.lax.DotAlgorithmPreset.DEFAULT,) * 2,
               logits_dtype=jnp.dtype("float32"), logits_scale=q.shape[-1] ** -0.5, bias=None,
               logits_soft_cap=None, mask=base.Mask(is_causal=causal), dropout_mask=None,
               dropout_rate=0.0, paging_info=None, q_indices=None, k_indices=None,
               normalize_output=True)  # fmt: skip
    return grads["q"], grads["k"], grads["v"]


def pallas_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False
) -> jax.Array:
    """Our forward, ``pf.attention(q, k, v, causal=causal, backend="pallas")``: q ``[batch,
    heads, seq, head_dim]``, k and v ``[batch, kv_heads, seq_kv, head_dim]``."""
    import pallas_flash as pf

    return pf.attention(q, k, v, causal=causal, backend="pallas")


def pallas_attention_backward(
    lse: jax.Array,
    out: jax.Array,
    dout: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Our backward (the ``pallas`` backend's kernels at their default blocks) from the
    forward's residuals, as ``jax.grad`` of ``pf.attention`` runs it: ``lse [batch, heads, 1,
    seq]`` float32, ``out`` and ``dout`` like q's output, q ``[batch, heads, seq, head_dim]``,
    k and v ``[batch, kv_heads, seq_kv, head_dim]``; the gradients of q, k and v."""
    from pallas_flash.specs import AttentionSpec
    from pallas_flash_pallas.kernels.backward import flash_backward

    spec = AttentionSpec(sm_scale=q.shape[-1] ** -0.5, causal=causal,
                         q_offset=k.shape[2] - q.shape[2])  # fmt: skip
    dq, dk, dv, _ = flash_backward(q, k, v, None, out, lse, dout, spec=spec)
    return dq, dk, dv
