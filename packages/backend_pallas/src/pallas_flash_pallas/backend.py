"""The ``pallas`` backend: the FlashAttention-2 Pallas kernel, built for TPU v5e."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_flash as pf
from pallas_flash_pallas.blocks.block_sizes import BlockSizes
from pallas_flash_pallas.kernels.attention import flash_attention
from pallas_flash_pallas.mesh.context_parallel import context_parallel_attention


def kernel_bias(
    bias: jax.Array | None, mask: jax.Array | None, q_len: int, kv_len: int
) -> jax.Array | None:
    """The bias the kernels stream, ``[batch or 1, heads or 1, q_len, kv_len]``, from
    `pf.dot_product_attention`'s ``bias`` and boolean ``mask`` (rank 4, broadcastable): the
    bias with ``-inf`` where the mask hides a key (the mask alone: ``0`` or ``-inf`` in
    bfloat16), its sequence axes broadcast to their lengths (the kernels read it by blocks);
    the batch and head axes stay as they are. None if neither is given."""
    if mask is not None:
        base = jnp.zeros((), jnp.bfloat16) if bias is None else bias
        bias = jnp.where(mask, base, jnp.asarray(-jnp.inf, base.dtype))
    if bias is None:
        return None
    return jnp.broadcast_to(bias, (*bias.shape[:2], q_len, kv_len))


class PallasBackend(pf.Backend):
    """FlashAttention-2 in Pallas TPU kernels: a forward kernel and a backward kernel that
    computes dq, dk and dv in one pass.

    Tuned for v5e; on v4, v5p and v6e the kernels size their blocks and VMEM for the chip
    (`pallas_flash.tpu`).

    On TPU the kernel is compiled by Mosaic; elsewhere it runs in Pallas's TPU interpreter
    (see `pallas_flash.interpret` for the environment variables that force either).

    Args:
      block_sizes: the kernels' block sizes; default `BlockSizes()`: the defaults of each
        call and TPU generation (`block_sizes.default_block_sizes`). The installed
        ``pallas`` backend uses the defaults; to use other sizes, register another instance
        under its own name (see the package README) and select it by that name.
      name: the name to select this instance by.
    """

    name = "pallas"
    capabilities = frozenset(
        {
            pf.Capability.ATTENTION,
            pf.Capability.GRAD,
            pf.Capability.CAUSAL,
            pf.Capability.GQA,
            pf.Capability.SEGMENT_IDS,
            pf.Capability.SLIDING_WINDOW,
            pf.Capability.SOFTCAP,
            pf.Capability.SINKS,
            pf.Capability.BIAS,
            pf.Capability.MASK,
            pf.Capability.VALUE_HEAD_DIM,
            pf.Capability.CONTEXT_PARALLEL,
        }
    )
    platforms = frozenset({"tpu"})
    priority = 100

    def __init__(self, block_sizes: BlockSizes | None = None, *, name: str = "pallas") -> None:
        self.block_sizes = BlockSizes() if block_sizes is None else block_sizes
        self.name = name

    def __repr__(self) -> str:
        return f"PallasBackend({self.block_sizes!r}, name={self.name!r})"

    def attention(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        spec: pf.AttentionSpec,
        *,
        segment_ids: pf.SegmentIds | None = None,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        sinks: jax.Array | None = None,
        mesh: jax.sharding.Mesh | None = None,
        context_layout: pf.context_layout.ContextLayout = "contiguous",
        context_exchange: pf.context_layout.ContextExchange = "ring",
    ) -> jax.Array:
        if mesh is None:
            bias = kernel_bias(bias, mask, q.shape[2], k.shape[2])
            return flash_attention(q, k, v, segment_ids, sinks, bias, spec, self.block_sizes)
        unsupported = {"bias": bias is not None, "mask": mask is not None}
        used = [name for name, given in unsupported.items() if given]
        if used:
            raise pf.UnsupportedFeatureError(
                f"backend {self.name!r} does not support {', '.join(used)} with a mesh "
                "(context parallelism): scores' worth of values for a sequence longer than a "
                "chip; segment ids and a sliding window are supported"
            )
        return context_parallel_attention(
            q, k, v, spec=spec, mesh=mesh, layout=context_layout, exchange=context_exchange,
            block_sizes=self.block_sizes, sinks=sinks, segment_ids=segment_ids,
        )  # fmt: skip
