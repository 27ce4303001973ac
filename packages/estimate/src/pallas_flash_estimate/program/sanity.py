"""The estimate held against its ops' rooflines: no figure the program cannot take.

An estimate counts each op's bundles and MXU cycles over the loops its listing runs, each loop
as often as the program says (a grid's steps, a trip count read from constants, or the
``loop_trips`` a caller gives). Where a count is wrong, the figure is wrong by as much: a loop
counted once instead of a thousand times, or a placeholder's 2^31 steps. The flops an op does
bound what its counted loops may come to:

- **floor**: no op runs faster than its flops at the chip's peak. A Pallas kernel that
  declares its flops (``pl.CostEstimate``, in its custom call's backend config) and is
  estimated under ``FLOOR_SHARE`` of ``flops / peak`` has had loops counted too few times.
  The share allows a kernel that declares the flops of blocks it then skips (a causal mask's
  upper half: the schedule sees them skipped). The whole program is held to the same floor
  on the flops XLA's cost analysis counts.
- **ceiling**: the MXU work the counted loops issue, the busiest MXU's cycles at the chip's
  peak (``mxu seconds x peak``: the other MXUs are at most as busy, and a vmatmul whose
  operands fill part of the MXU counts whole), exceeds the declared flops only by what that
  counting wastes: at most ``MXU_WASTE`` times (a 256-wide MXU fed 64-deep operands wastes 4
  times, the busiest of two MXUs counted for both 2, float32 passes 2). More, and the loops
  were counted too many times.

An op outside either bound gets a reason (`implausible`), and the public estimate refuses to
give a number (`program_estimate.ImplausibleEstimateError`).
"""

from __future__ import annotations

FLOOR_SHARE = 0.5
"""The least share of its declared flops at peak an op's estimate may come to."""

MXU_WASTE = 16
"""How many times its declared flops an op's counted MXU work may come to."""


def implausible(
    name: str,
    static_seconds: float,
    mxu_seconds: float | None,
    flops: float | None,
    peak_flops: float,
) -> str | None:
    """Why one run of op ``name`` cannot take ``static_seconds`` (its busiest MXU busy
    ``mxu_seconds``) when it does ``flops`` (a kernel's ``cost_estimate``, or for a whole
    program XLA's count, which takes its kernels' from theirs; None or 0: not declared,
    nothing to hold it to); None when it can."""
    if not flops:
        return None
    floor = flops / peak_flops
    if static_seconds < FLOOR_SHARE * floor:
        return (f"{name}: estimated {static_seconds * 1e3:.4g} ms, under {FLOOR_SHARE:g} of its "
                f"{flops:.4g} declared flops at peak ({floor * 1e3:.4g} ms): loops counted too "
                "few times")  # fmt: skip
    if mxu_seconds is not None and mxu_seconds > MXU_WASTE * floor:
        return (f"{name}: its counted loops keep an MXU busy {mxu_seconds * 1e3:.4g} ms, over "
                f"{MXU_WASTE} times its {flops:.4g} declared flops at peak "
                f"({floor * 1e3:.4g} ms): loops counted too many times")  # fmt: skip
    return None
