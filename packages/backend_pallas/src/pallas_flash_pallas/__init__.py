"""The Pallas backend of Pallas-Flash (backend name ``pallas``): FlashAttention-2 for TPU v5e.

Public API: `PallasBackend` (the backend; its constructor takes `BlockSizes`), `BlockSizes`,
`flash_attention` (differentiable attention of validated inputs), and the kernels' own entry
points `flash_forward` (output and log-sum-exp), `flash_output` (output alone) and
`flash_backward` (dq, dk, dv).

Layout: the kernels (`kernels`), the block policy they are sized and scheduled by (`blocks`),
the mesh layer that runs them over a sequence split across chips (`mesh`), and the backend
that serves calls through them (`backend`, registered by `plugin`).
"""

from pallas_flash_pallas.backend import PallasBackend
from pallas_flash_pallas.blocks.block_sizes import BlockSizes
from pallas_flash_pallas.kernels.attention import flash_attention
from pallas_flash_pallas.kernels.backward import flash_backward
from pallas_flash_pallas.kernels.forward import flash_forward, flash_output

__all__ = [
    "BlockSizes",
    "PallasBackend",
    "flash_attention",
    "flash_backward",
    "flash_forward",
    "flash_output",
]
