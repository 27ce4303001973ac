"""The Split-KV decode kernel: partial attention of one query token per sequence over splits
of one device's KV cache.

Layouts: q ``[batch, kv_heads, group, head_dim]`` (the query heads of each kv head together:
a free view of ``[batch, q_heads, head_dim]``); the caches ``[batch, kv_heads, max_len,
head_dim]``; ``lengths [batch]`` int32. Outputs per split: the normalised partial output
``[batch, kv_heads, splits, group, head_dim]`` and its log-sum-exp ``[batch, kv_heads, splits,
group]``, both float32.

Grid ``(batch, kv_heads, splits, blocks per split)``: the first three axes are parallel, the
last sequential. Each step reads one ``[block_kv, head_dim]`` block of K and of V once for all
``group`` query heads of its kv head (GQA/MQA read each cache byte once) and folds it into a
running max, sum and accumulator (the online softmax, float32). ``lengths`` is prefetched into
SMEM and clipped to ``[0, max_len]`` where it is read (the index maps and the kernel: traced
lengths cannot be checked beforehand, and one past ``max_len`` would read a partial last block
as whole, or point an index map past the cache). The index maps re-point the steps past
``ceil(lengths[b] / block_kv)`` blocks at the last valid block, so no DMA is issued for them,
and the kernel skips them. Cache slots at and past ``lengths[b]`` may hold anything, NaN
included: their scores are masked (on every step: a few vregs of one query row) and, in the
block that holds the sequence's end, their V rows are zeroed in the VMEM buffer before the
one fold of the step. One fold body, not a masked and an unmasked copy: a static schedule
counts both copies of a data-dependent branch, and the matmuls (and their weight pushes)
are the part of a decode step worth counting exactly. A split that sees no valid
position yields output 0 and log-sum-exp ``-inf``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import interpret
from pallas_flash.masking import apply_softcap
from pallas_flash.specs import DecodeSpec
from pallas_flash_splitkv.blocks import LANES, DecodeBlocks

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # q k^T
_NN = (((1,), (0,)), ((), ()))  # p v


def _length(lengths_ref: jax.Ref, b: jax.Array, max_len: int) -> jax.Array:
    """Sequence ``b``'s length clipped to ``[0, max_len]``."""
    return jnp.clip(lengths_ref[b], 0, max_len)


def _kernel(
    lengths_ref: jax.Ref,
    q_ref: jax.Ref,
    k_ref: jax.Ref,
    v_ref: jax.Ref,
    o_ref: jax.Ref,
    lse_ref: jax.Ref,
    m_ref: jax.Ref,
    l_ref: jax.Ref,
    acc_ref: jax.Ref,
    *,
    spec: DecodeSpec,
    max_len: int,
    block_kv: int,
    blocks_per_split: int,
    precision: lax.Precision | None,
) -> None:
    """One grid step ``(b, h, s, t)``: folds cache block ``s * blocks_per_split + t``.

    Refs: ``lengths [batch]`` (SMEM); q ``[group, head_dim]``; k, v ``[block_kv, head_dim]``;
    outputs ``[group, head_dim]`` and log-sum-exp ``[group, 128]`` (equal lanes); scratch:
    running max and sum ``[group, 128]`` and accumulator ``[group, head_dim]``, float32.
    """
    b, s, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    length = _length(lengths_ref, b, max_len)
    first = (s * blocks_per_split + t) * block_kv  # cache position of the block's first row

    @pl.when(t == 0)
    def _start() -> None:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
        l_ref[...] = jnp.zeros(l_ref.shape, _F32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

    @pl.when((first < length) & (first + block_kv > length))
    def _zero_stale_values() -> None:  # a stale NaN would poison p @ v even where p is 0
        pos = first + lax.broadcasted_iota(jnp.int32, v_ref.shape, 0)
        v_ref[...] = jnp.where(pos < length, v_ref[...], jnp.zeros_like(v_ref))

    @pl.when(first < length)
    def _fold() -> None:
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        scores = lax.dot_general(q, k, _NT, preferred_element_type=_F32, precision=precision)
        scores = apply_softcap(scores * spec.sm_scale, spec.softcap)  # [group, block_kv]
        pos = first + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where(pos < length, scores, -jnp.inf)
        m_prev = m_ref[...]
        m_next = jnp.maximum(
            m_prev, jnp.max(scores, axis=1, keepdims=True)
        )  # finite: first < length
        p = jnp.exp(scores - m_next[:, :1])
        alpha = jnp.exp(m_prev - m_next)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(
            p.astype(v.dtype), v, _NN, preferred_element_type=_F32, precision=precision
        )
        acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv

    @pl.when(t == blocks_per_split - 1)
    def _finish() -> None:
        total = l_ref[...]
        seen = total > 0.0  # the sum is >= 1 once the split has seen a position
        inverse = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
        o_ref[...] = acc_ref[...] * inverse[:, :1]
        lse_ref[...] = jnp.where(seen, m_ref[...] + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)


def split_partials(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    spec: DecodeSpec,
    blocks: DecodeBlocks,
    devices: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Partial outputs and log-sum-exps of each split (layouts in the module doc).

    Runs the kernel as Mosaic or interpreted, as `pallas_flash.interpret` decides.

    Args:
      q: ``[batch, kv_heads, group, head_dim]``.
      k_cache, v_cache: ``[batch, kv_heads, max_len, head_dim]``, dtype of q.
      lengths: ``[batch]`` int32; values past ``[0, max_len]`` count as the nearest end.
      spec: the call's settings.
      blocks: the tiling.
      devices: how many devices run the kernel at once (inside ``shard_map``).

    Returns:
      ``(out, lse)``: ``[batch, kv_heads, splits, group, head_dim]`` and
      ``[batch, kv_heads, splits, group]``, float32.

    Raises:
      ValueError: ``blocks.block_kv`` is illegal for this cache.
    """
    return _split_partials(q, k_cache, v_cache, lengths, spec=spec, blocks=blocks, devices=devices)


def _split_partials_kernel(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    spec: DecodeSpec,
    blocks: DecodeBlocks,
    interpret: pltpu.InterpretParams | bool | None,
) -> tuple[jax.Array, jax.Array]:
    """`split_partials` with the interpreter's settings (True: the generic interpreter), or
    None for Mosaic."""
    batch, kv_heads, group, head_dim = q.shape
    max_len = k_cache.shape[2]
    block_kv, splits, per_split = blocks.for_cache(max_len)

    def kv_map(b, h, s, t, lengths_ref):  # past the sequence's end: stay on its last block
        last = jnp.maximum(pl.cdiv(_length(lengths_ref, b, max_len), block_kv) - 1, 0)
        return b, h, jnp.minimum(s * per_split + t, last), 0

    def q_map(b, h, s, t, lengths_ref):
        return b, h, 0, 0

    def out_map(b, h, s, t, lengths_ref):
        return b, h, s, 0, 0

    kernel = functools.partial(
        _kernel,
        spec=spec,
        max_len=max_len,
        block_kv=block_kv,
        blocks_per_split=per_split,
        precision=lax.Precision.HIGHEST if q.dtype == np.float32 else None,
    )
    kv_spec = pl.BlockSpec((None, None, block_kv, head_dim), kv_map)
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((batch, kv_heads, splits, group, head_dim), _F32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, group, LANES), _F32),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, kv_heads, splits, per_split),
            in_specs=[pl.BlockSpec((None, None, group, head_dim), q_map), kv_spec, kv_spec],
            out_specs=(
                pl.BlockSpec((None, None, None, group, head_dim), out_map),
                pl.BlockSpec((None, None, None, group, LANES), out_map),
            ),
            scratch_shapes=[
                pltpu.VMEM((group, LANES), _F32),
                pltpu.VMEM((group, LANES), _F32),
                pltpu.VMEM((group, head_dim), _F32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=False if interpret is None else interpret,
        name="pallas_flash_split_kv_decode",
    )(lengths, q, k_cache, v_cache)
    return out, lse[..., 0]


_split_partials = interpret.jit_kernel(_split_partials_kernel, ("spec", "blocks"))
