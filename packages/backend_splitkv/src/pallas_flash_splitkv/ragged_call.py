"""One ``pallas_call`` of the ragged kernel (`ragged_kernel`): its operands in HBM (the query
rows, the cache's arrays, a packed pool's new tokens), its outputs (the output rows and, where
the kernel writes the new tokens, the pool, each aliased to its first value), its VMEM scratch
and the scoped-VMEM limit asked of Mosaic, and the bytes it declares to XLA."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_flash import tpu
from pallas_flash.kv_packing import PACKED_DTYPE
from pallas_flash.memory_space import in_hbm
from pallas_flash.specs import RaggedSpec
from pallas_flash_splitkv import ragged_blocks
from pallas_flash_splitkv.blocks import LANES
from pallas_flash_splitkv.ragged_kernel import kernel

_F32 = jnp.float32


SCORE_TEMPORARIES = 3
"""``[rows, block_kv]`` float32 arrays each kv head of a grid step keeps live at once in a
fold (scores, their exponentials, the probabilities cast for the second matmul; the step's
heads are folded together, `ragged_fold.fold_block`), beside the scratch: the VMEM
estimate's temporaries (`kernel_call` asks Mosaic for a scoped-VMEM limit from it; at 4 kv
heads a step, items of 128 tokens of 4 query heads and kv blocks of 1024 positions outgrew
Mosaic's default 16 MiB)."""


def _vmem_bytes(scratch: object) -> int:
    """Bytes of one VMEM scratch buffer (0 for semaphores and SMEM)."""
    if getattr(scratch, "memory_space", None) != pltpu.VMEM:
        return 0
    return math.prod(scratch.shape) * jnp.dtype(scratch.dtype).itemsize


def kernel_call(
    q_rows: jax.Array,
    out: jax.Array,
    prefetch: list[jax.Array],
    arrays: list[jax.Array],
    new: jax.Array | None,
    sinks: jax.Array | None,
    spec: RaggedSpec,
    call: ragged_blocks.KernelCall,
    per_block: int,
    heads: int,
    pages_per_sequence: int,
    interpret: pltpu.InterpretParams | bool | None,
) -> tuple[jax.Array, jax.Array | None]:
    """One `pallas_call` of the kernel over ``q_rows [tokens, kv_heads / heads, heads x group,
    head_dim]``, ``heads`` kv heads a grid step: ``out`` (same layout) with the rows of the
    call's tokens written, the others as they were; and for a packed pool (``arrays``, its
    one array), the pool with the call's new tokens written from ``new`` (``[kv_heads,
    tokens, head_dim]`` words, `pallas_flash.pack_kv`), else None."""
    _, head_groups, head_rows, head_dim = q_rows.shape
    group = head_rows // heads
    packed = arrays[0].dtype == PACKED_DTYPE
    writes = new is not None
    kv_arrays = arrays[:1] if packed else arrays[:2]
    rows = group * call.block_q
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    inputs, in_specs = [q_rows], [hbm]
    if sinks is not None:
        per_row = jnp.repeat(sinks.astype(_F32).reshape(-1, group), call.block_q, axis=1)
        inputs.append(jnp.broadcast_to(per_row[..., None], (*per_row.shape, LANES)))
        in_specs.append(pl.BlockSpec((heads, rows, LANES), lambda h, *refs: (h, 0, 0)))
    block_kv = per_block * arrays[0].shape[2]
    entries = call.sequences
    row_block = (2, call.block_q, head_rows, head_dim)
    scratch = [
        pltpu.VMEM(row_block, q_rows.dtype),
        pltpu.VMEM(row_block, q_rows.dtype),
        pltpu.VMEM((heads, rows, head_dim), q_rows.dtype),
        pltpu.VMEM((heads, rows, LANES), _F32),
        pltpu.VMEM((heads, rows, LANES), _F32),
        pltpu.VMEM((heads, rows, head_dim), _F32),
        *(pltpu.VMEM((2, entries, heads, block_kv, head_dim), x.dtype) for x in kv_arrays),
        *(pltpu.VMEM((2, entries, heads, block_kv), _F32) for _ in arrays[2:]),
        pltpu.SemaphoreType.DMA((2, len(arrays))),
        pltpu.SemaphoreType.DMA((2, 2)),
        pltpu.SMEM((1,), jnp.int32),
        pltpu.SMEM((1,), jnp.int32),
        pltpu.SMEM((2, 2 * entries), jnp.int32),
        *([pltpu.SemaphoreType.DMA((2,))] if writes else []),  # the new tokens' writes
    ]
    # the step's heads at once, and each entry's scores before they are chosen from
    temporaries = (SCORE_TEMPORARIES + entries - 1) * heads * rows * block_kv * 4
    sinks_block = 2 * heads * rows * LANES * 4 if sinks is not None else 0  # double-buffered
    needed = sum(_vmem_bytes(s) for s in scratch) + sinks_block + temporaries
    body = functools.partial(
        kernel, spec=spec, block_q=call.block_q, sequences=entries, pages_per_block=per_block,
        pages_per_sequence=pages_per_sequence, quantized=len(arrays) == 4,
        packed=packed, writes=writes, has_sinks=sinks is not None,
    )  # fmt: skip
    pool = arrays[0]
    aliases = {len(prefetch) + len(inputs) + len(arrays) + writes: 0}
    out_shape = [jax.ShapeDtypeStruct(out.shape, out.dtype)]
    inputs += [in_hbm(x, interpret) for x in arrays]
    if writes:  # the pool written in place: an output aliased to it
        aliases[len(prefetch) + len(inputs) - 1] = 1
        out_shape.append(jax.ShapeDtypeStruct(pool.shape, pool.dtype))
        inputs.append(in_hbm(new, interpret))
    # what it moves at most, each HBM array once (every page of the pool: the share its
    # sequences hold is the workload's); flops and exponentials depend on the lengths
    most = sum(math.prod(x.shape) * x.dtype.itemsize for x in [*inputs, out])
    outputs = pl.pallas_call(
        body,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(head_groups,),
            in_specs=[*in_specs, *[hbm] * (len(inputs) - len(in_specs)), hbm],
            out_specs=[hbm] * len(out_shape),
            scratch_shapes=scratch,
        ),
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            disable_bounds_checks=True,
            vmem_limit_bytes=tpu.scoped_vmem_limit(needed, tpu.current_generation()),
        ),
        interpret=False if interpret is None else interpret,
        name=call.name,
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=most),
    )(*prefetch, *inputs, out)
    return outputs[0], outputs[1] if writes else None
