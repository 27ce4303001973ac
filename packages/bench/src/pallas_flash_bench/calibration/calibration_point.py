"""One calibration point: a program, the time a source measured for it on one TPU chip, the
source, and how it was timed:

- ``host``: wall clock around one call from Python (``timeit`` of ``block_until_ready(f(x))``,
  as jax's guides time): the device time plus a dispatch and synchronisation cost per call;
- ``device``: the op's own time on the device (a profiler's), nothing around it.

``role`` says whether the calibration is fitted on the point (``fit``) or only held against
it (``validate``): the fit never sees the validation points.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from pallas_flash_estimate.aot.program_ref import ProgramRef

Timing = Literal["host", "device"]
Role = Literal["fit", "validate"]


@dataclasses.dataclass(frozen=True)
class CalibrationPoint:
    """One program and the time a source measured for it on one chip.

    ``program``: compiled by the calibration run (`pallas_flash_estimate.aot.worker`); or
    None, with ``estimate`` its whole-program estimate made elsewhere (MaxText's step:
    `maxtext_steps`). ``kind``: the kind of program it stands for where that is not read
    from its estimate (``train step``)."""

    name: str
    program: ProgramRef | None
    measured_seconds: float
    source: str
    timing: Timing
    role: Role
    estimate: Mapping[str, Any] | None = None
    kind: str | None = None

    def to_json(self) -> dict[str, object]:
        program = None if self.program is None else self.program.to_json()
        return {"name": self.name, "program": program, "kind": self.kind,
                "measured_seconds": self.measured_seconds, "source": self.source,
                "timing": self.timing, "role": self.role}  # fmt: skip
