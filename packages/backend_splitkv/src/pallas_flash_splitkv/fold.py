"""The online-softmax fold of one block of the cache into a split's running results, shared
by the decode kernels of a contiguous cache (`kernel`) and of a paged one (`paged_kernel`).

A block is ``block_kv`` positions of every kv head, ``[kv_heads, block_kv, head_dim]``, folded
into the heads' running maxima, sums and accumulators (float32) by matmuls batched over the
head axis: per head, the compiler's latency model chains the scratch reads and writes of one
head after another's (4x the static critical path at 8 kv heads). An int8 block is converted
to q's dtype in VMEM (to bfloat16 with its rows paired, `int8_rows`, where the block allows),
a packed block's words unpacked into keys and values (`pallas_flash.kv_packing`), and an int8
block's scales applied to the scores (K) and to the probabilities (V), ``[group, block_kv]``
products rather than ``[block_kv, head_dim]`` ones. Positions at and past the sequence's
length are masked, and their V rows zeroed (a stale NaN would poison ``p @ v`` even where
``p`` is 0). A split that sees no position yields output 0 and
log-sum-exp ``-inf``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash.kv_packing import unpack_kv
from pallas_flash.masking import apply_softcap
from pallas_flash.specs import DecodeSpec
from pallas_flash_splitkv import int8_rows

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The static facts the kernel body needs."""

    spec: DecodeSpec
    max_len: int  # positions per sequence the cache can hold
    block_kv: int
    blocks_per_split: int
    paged: bool  # read through a page table
    quantized: bool
    packed: bool  # k the words of keys and values (`pallas_flash.kv_packing`), v None
    compute_dtype: jnp.dtype
    precision: lax.Precision | None

    @property
    def pairs_int8_rows(self) -> bool:
        """Whether an int8 block goes to bfloat16 through `int8_rows` (its rows reordered)."""
        return self.quantized and self.compute_dtype == jnp.bfloat16 and self.block_kv % 128 == 0


def tiling_for(
    q: jax.Array,
    spec: DecodeSpec,
    *,
    max_len: int,
    block_kv: int,
    blocks_per_split: int,
    paged: bool,
    quantized: bool,
    packed: bool = False,
) -> Tiling:
    """The `Tiling` of a call with query ``q``: computing in q's dtype (float32 at the
    highest matmul precision)."""
    return Tiling(
        spec=spec, max_len=max_len, block_kv=block_kv, blocks_per_split=blocks_per_split,
        paged=paged, quantized=quantized, packed=packed, compute_dtype=q.dtype,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
    )  # fmt: skip


def clipped_length(lengths_ref: jax.Ref, b: jax.Array, max_len: int) -> jax.Array:
    """Sequence ``b``'s length clipped to ``[0, max_len]``."""
    return jnp.clip(lengths_ref[b], 0, max_len)


class StepRefs(NamedTuple):
    """One step's refs: q ``[kv_heads, group, head_dim]``; the block of k, v ``[kv_heads,
    block_kv, head_dim]`` (packed: k the block's uint32 words, v None) and, when quantized,
    their scales ``[kv_heads, block_kv]`` (else None); the running max and sum ``[kv_heads,
    group, 128]`` and accumulator ``[kv_heads, group, head_dim]``, float32."""

    q: jax.Ref
    k: jax.Ref
    v: jax.Ref | None
    k_scales: jax.Ref | None
    v_scales: jax.Ref | None
    max: jax.Ref
    sum: jax.Ref
    acc: jax.Ref


def start(step: StepRefs) -> None:
    """Resets the running max, sum and accumulator of a split."""
    step.max[...] = jnp.full(step.max.shape, -jnp.inf, _F32)
    step.sum[...] = jnp.zeros(step.sum.shape, _F32)
    step.acc[...] = jnp.zeros(step.acc.shape, _F32)


def fold_block(step: StepRefs, first: jax.Array, length: jax.Array, tiling: Tiling) -> None:
    """Folds the block at position ``first`` (which holds a position ``< length``) into the
    running results; in the block that holds the sequence's end, the V rows (V scales, for
    int8; a packed block's words) at and past ``length`` are zeroed first: a stale NaN would
    poison p @ v even where p is 0 (int8 values are finite, their scales need not be)."""
    stale = step.v_scales if tiling.quantized else step.k if tiling.packed else step.v

    @pl.when(first + tiling.block_kv > length)
    def _zero_stale_values() -> None:
        pos = first + lax.broadcasted_iota(jnp.int32, stale.shape, 1)
        stale[...] = jnp.where(pos < length, stale[...], jnp.zeros_like(stale))

    _fold_heads(step, first, length, tiling)


def finish(step: StepRefs, o_ref: jax.Ref, lse_ref: jax.Ref) -> None:
    """Writes a split's normalised output and log-sum-exp (0 and ``-inf`` if it saw
    nothing)."""
    total = step.sum[...]
    seen = total > 0.0  # the sum is >= 1 once the split has seen a position
    inverse = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
    o_ref[...] = step.acc[...] * inverse[..., :1]
    lse_ref[...] = jnp.where(seen, step.max[...] + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)


def _block_operands(step: StepRefs, tiling: Tiling) -> tuple[jax.Array, ...]:
    """The block's K and V in the compute dtype ``[kv_heads, block_kv, head_dim]``, their
    scales ``[kv_heads, block_kv]`` (None unless quantized) and each row's offset from the
    block's first position ``[1, block_kv]``: in order, or in `int8_rows.paired_order`."""
    if tiling.pairs_int8_rows:
        k, v = (int8_rows.to_bfloat16_paired(x[...]) for x in (step.k, step.v))
        scales = int8_rows.pair_lanes(jnp.concatenate([step.k_scales[...], step.v_scales[...]]))
        heads = k.shape[0]
        return k, v, scales[:heads], scales[heads:], int8_rows.paired_order(tiling.block_kv)
    if tiling.packed:
        k, v = unpack_kv(step.k[...], tiling.compute_dtype)
    else:
        k, v = (x[...].astype(tiling.compute_dtype) for x in (step.k, step.v))
    scales = [x[...] if tiling.quantized else None for x in (step.k_scales, step.v_scales)]
    return k, v, *scales, lax.broadcasted_iota(jnp.int32, (1, tiling.block_kv), 1)


def _fold_heads(step: StepRefs, first: jax.Array, length: jax.Array, tiling: Tiling) -> None:
    """Folds the block of every kv head into its running max, sum and accumulator, all heads
    at once (batched matmuls over the head axis): one dependency chain per step, not one per
    head through the scratch refs."""
    dtype, precision = tiling.compute_dtype, tiling.precision
    k, v, k_scales, v_scales, offsets = _block_operands(step, tiling)
    scores = jnp.einsum(
        "hgd,hkd->hgk", step.q[...], k, preferred_element_type=_F32, precision=precision
    )  # [kv_heads, group, block_kv]
    if tiling.quantized:
        scores = scores * k_scales[:, None, :]
    scores = apply_softcap(scores * tiling.spec.sm_scale, tiling.spec.softcap)
    scores = jnp.where((first + offsets)[None] < length, scores, -jnp.inf)
    m_prev = step.max[...]
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=2, keepdims=True))  # finite
    p = jnp.exp(scores - m_next[..., :1])
    alpha = jnp.exp(m_prev - m_next)
    step.max[...] = m_next
    step.sum[...] = alpha * step.sum[...] + jnp.sum(p, axis=2, keepdims=True)
    if tiling.quantized:
        p = p * v_scales[:, None, :]
    pv = jnp.einsum(
        "hgk,hkd->hgd", p.astype(dtype), v, preferred_element_type=_F32, precision=precision
    )
    step.acc[...] = step.acc[...] * alpha[..., :1] + pv
