"""TPU generations, and which one a kernel is built for.

Kernel backends size their VMEM use (block sizes, scoped-VMEM limits) from the generation a
call runs on, chosen at trace time by `current_generation`:

1. the ``PALLAS_FLASH_TPU`` environment variable (``v4``, ``v5e``, ``v5p``, ``v6e``,
   ``v7x``), needed when compiling ahead of time for a TPU the host does not have;
2. else, on a TPU, the first device's ``device_kind``;
3. else (no TPU: the kernels run in Pallas's TPU interpreter) v5e, the generation the
   kernels are tuned for.

A TPU of a kind not listed here gets `UNKNOWN`, sized for the smallest VMEM of any listed
generation so that kernels still compile, with a warning naming the environment variable.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import jax

GENERATION_ENV_VAR = "PALLAS_FLASH_TPU"

MiB = 1 << 20
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    """One TPU generation, as the kernels see it.

    Attributes:
      name: e.g. ``v5e``.
      device_kinds: ``jax.Device.device_kind`` strings of its chips.
      vmem_bytes: VMEM of one TensorCore.
      tensorcores: TensorCores one device drives (2: megacore, which splits a kernel's
        parallel grid axes between its cores). A v7x chip's two TensorCores are two devices
        without megacore: 1.
      hbm_bytes: HBM of one device (a v7x device holds half its chip's).
      mxu_width: rows and columns of one MXU (jax's ``tpu_info``: 256 from v6e on).
    """

    name: str
    device_kinds: tuple[str, ...]
    vmem_bytes: int
    tensorcores: int
    hbm_bytes: int
    mxu_width: int = 128


GENERATIONS = {
    generation.name: generation
    for generation in (
        TpuGeneration("v4", ("TPU v4",), 16 * MiB, 2, 32 * GiB),
        TpuGeneration("v5e", ("TPU v5 lite", "TPU v5e"), 128 * MiB, 1, 16 * GiB),
        TpuGeneration("v5p", ("TPU v5", "TPU v5p"), 64 * MiB, 2, 95 * GiB),
        TpuGeneration("v6e", ("TPU v6 lite", "TPU v6e"), 128 * MiB, 1, 32 * GiB, 256),
        TpuGeneration("v7x", ("TPU7x", "TPU v7x"), 64 * MiB, 1, 96 * GiB, 256),
    )
}
"""The generations the kernels are sized for, by name."""

DEFAULT = GENERATIONS["v5e"]
"""The generation the kernels are tuned for, and the one assumed off TPU."""

UNKNOWN = TpuGeneration(
    "unknown",
    (),
    min(g.vmem_bytes for g in GENERATIONS.values()),
    max(g.tensorcores for g in GENERATIONS.values()),
    min(g.hbm_bytes for g in GENERATIONS.values()),
)
"""A TPU of an unlisted kind: the least VMEM and HBM of any listed generation."""


def for_device_kind(device_kind: str) -> TpuGeneration:
    """The generation of a TPU ``device_kind``, or `UNKNOWN` (with a warning)."""
    for generation in GENERATIONS.values():
        if device_kind in generation.device_kinds:
            return generation
    warnings.warn(
        f"unknown TPU device kind {device_kind!r}: kernels are sized for "
        f"{UNKNOWN.vmem_bytes // MiB} MiB of VMEM; set {GENERATION_ENV_VAR} to one of "
        f"{sorted(GENERATIONS)} to choose",
        stacklevel=2,
    )
    return UNKNOWN


def current_generation() -> TpuGeneration:
    """The generation kernels traced now are built for (see the module doc).

    Raises:
      ValueError: ``PALLAS_FLASH_TPU`` names no known generation.
    """
    name = os.environ.get(GENERATION_ENV_VAR, "").strip()
    if name:
        if name not in GENERATIONS:
            raise ValueError(
                f"{GENERATION_ENV_VAR} must be one of {sorted(GENERATIONS)} or unset, got {name!r}"
            )
        return GENERATIONS[name]
    if jax.default_backend() == "tpu":
        return for_device_kind(jax.devices()[0].device_kind)
    return DEFAULT


MIN_VMEM_LIMIT_BYTES = 32 * MiB
"""The smallest scoped-VMEM limit the kernels ask Mosaic for, where the core has that much
(Mosaic's own default is 16 MiB on v4, v5e and v5p)."""

VMEM_HEADROOM = 1.25
"""The scoped-VMEM limit a kernel asks for, over its estimated need."""


def scoped_vmem_limit(needed: int, generation: TpuGeneration) -> int:
    """The scoped-VMEM limit to compile a kernel with that needs an estimated ``needed`` bytes
    on ``generation``: the estimate with `VMEM_HEADROOM`, at least `MIN_VMEM_LIMIT_BYTES`, at
    most the core's VMEM."""
    wanted = max(MIN_VMEM_LIMIT_BYTES, math.ceil(VMEM_HEADROOM * needed))
    return min(generation.vmem_bytes, wanted)
