"""Where XLA keeps a kernel's operands: a cache or pool that a kernel copies by DMA stays in HBM.

XLA's memory-space assignment may place an operand of a Pallas call in VMEM (v5e has 128 MiB)
when the call's block spec leaves it anywhere (``pl.ANY``): a small model's cache pool is then
copied into VMEM and back whole around the call, where the kernel reads or writes only a few
of its pages (Llama-3.2-1B's int8 pools at 2 layers: 32 MiB each way a layer). A block spec's
memory space is Mosaic's alone; XLA is told by a constraint on the operand (an aliased
output follows its input).
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import tpu as pltpu


def in_hbm(array: jax.Array, interpret: object = None) -> jax.Array:
    """``array``, constrained to stay in HBM as the operand of the Pallas call it is passed to,
    when Mosaic compiles the call (``interpret`` None or False: the call's own argument). As
    it is for an interpreted call (the interpreter's ops take no memory space), and outside a
    trace (an eager call compiles the kernel alone, with nothing to place beside it)."""
    if interpret or not isinstance(array, jax.core.Tracer):
        return array
    return pltpu.with_memory_space_constraint(array, pltpu.HBM)
