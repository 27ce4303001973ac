"""A static estimate of how long a JAX program takes on a TPU, from the TPU compiler's own
output, without a TPU.

The public API: `estimate_program` (``fn(*args)`` compiled for one chip of a `Target` and
estimated: a `ProgramEstimate`, calibrated against published v5e measurements:
`CalibratedTime`), and the chips it estimates for, `TARGETS`.

Beneath it, a library by stage, as a program's compiled output flows through it:

- `pallas_flash_estimate.aot`: the compile (the one stage that imports JAX): a target's
  devices from libtpu's topology (`aot.devices`), a program named so that a worker can
  build it (`aot.program_ref`), compiled and recorded (`aot.compiled`), in a worker process
  whose libtpu writes its LLO dump (`aot.worker`).
- `pallas_flash_estimate.read`: the compiler's text, parsed: optimized HLO (`read.hlo`, and
  the kernel calls, collectives and copies in it: `read.hlo_ops`), libtpu's LLO dump files
  (`read.dump_files`), a kernel's VLIW bundles (`read.bundles`) and its critical path
  (`read.critical_path`).
- `pallas_flash_estimate.evaluate`: a listing evaluated: its loops and predicated regions and
  how often each bundle runs (`evaluate.bundle_listing`, on the scalar definitions of
  `evaluate.scalar_defs` and the data flow of `evaluate.scalar_flow`; per-bundle figures
  weighed the same way are `evaluate.bundle_weights`), loops whose trips are read from memory
  (`evaluate.loop_trips`), and the trips of a whole program's ``while`` loops
  (`evaluate.program_loops`).
- `pallas_flash_estimate.cost`: what that costs: a kernel's static schedule (`cost.llo`), its
  headline cycles and the share of its grid a call uses (`cost.kernel_cost`, whose
  `Occupancy` is what the estimator asks of a call), the same kernel under every estimate
  (`cost.spread`), its DMA traffic (`cost.dma`), an op's HBM bytes (`cost.op_bytes`), and how
  much of a program's collective and copy time its own schedule hides (`cost.overlap`).
- `pallas_flash_estimate.program`: a whole program's step, every op charged for its runs
  (`program.whole_program`), its collectives over the slice's torus (`program.ici`), and
  each op held against its flops (`program.sanity`: a loop counted too few or too many
  times gives no figure).
- `pallas_flash_estimate.calibration`: the static figure held against published
  measurements, and the error band each kind of program keeps.

`ANALYSIS_VERSION` names the estimator's analysis: results of another version are not to
be mixed with its own. The chips it estimates for, with the published figures it divides by, are
`pallas_flash_estimate.targets`. One kernel's cost, from the API down: `program_estimate`
-> `aot.worker` -> `program.whole_program` -> `cost.spread`.
"""

from pallas_flash_estimate.calibration import CalibratedTime
from pallas_flash_estimate.program.whole_program import ANALYSIS_VERSION
from pallas_flash_estimate.program_estimate import (
    ImplausibleEstimateError,
    ProgramEstimate,
    UnknownGridError,
    estimate_program,
)
from pallas_flash_estimate.targets import TARGETS, Target

__all__ = [
    "ANALYSIS_VERSION",
    "TARGETS",
    "CalibratedTime",
    "ImplausibleEstimateError",
    "ProgramEstimate",
    "Target",
    "UnknownGridError",
    "estimate_program",
]
