"""The Pallas backend of Pallas-Flash (backend name ``pallas``): FlashAttention-2 for TPU v5e.

Public API: `PallasBackend` (the backend; its constructor takes `BlockSizes`), `BlockSizes`,
`flash_attention` (differentiable attention of validated inputs), and the kernels' own entry
points `flash_forward` (output and log-sum-exp), `flash_output` (output alone) and
`flash_backward` (dq, dk, dv).
"""

from pallas_flash_pallas.attention import flash_attention
from pallas_flash_pallas.backend import PallasBackend
from pallas_flash_pallas.backward import flash_backward
from pallas_flash_pallas.block_sizes import BlockSizes
from pallas_flash_pallas.forward import flash_forward, flash_output

__all__ = [
    "BlockSizes",
    "PallasBackend",
    "flash_attention",
    "flash_backward",
    "flash_forward",
    "flash_output",
]
