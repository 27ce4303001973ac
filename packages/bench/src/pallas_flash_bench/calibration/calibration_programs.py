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


def pallas_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False
) -> jax.Array:
    """Our forward, ``pf.attention(q, k, v, causal=causal, backend="pallas")``: q ``[batch,
    heads, seq, head_dim]``, k and v ``[batch, kv_heads, seq_kv, head_dim]``."""
    import pallas_flash as pf

    return pf.attention(q, k, v, causal=causal, backend="pallas")
