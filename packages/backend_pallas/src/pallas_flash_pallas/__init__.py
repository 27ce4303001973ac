"""The Pallas backend of Pallas-Flash (backend name ``pallas``): FlashAttention-2 for TPU v5e.

Public API: `PallasBackend` (the backend; its constructor takes `BlockSizes`), `BlockSizes`,
and `flash_forward` (output and log-sum-exp of one call, for the backward pass and tests).
"""

from pallas_flash_pallas.backend import PallasBackend
from pallas_flash_pallas.block_sizes import BlockSizes
from pallas_flash_pallas.forward import flash_forward

__all__ = ["BlockSizes", "PallasBackend", "flash_forward"]
