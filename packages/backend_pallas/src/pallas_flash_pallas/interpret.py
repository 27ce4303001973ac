"""Whether a kernel runs as Mosaic (TPU machine code) or in Pallas's TPU interpreter.

The choice is made at trace time, in Python: ``lax.platform_dependent`` cannot hold an
interpreted kernel (the interpreter's ordered callbacks break the ``cond`` lowering).

Environment variables:
  ``PALLAS_FLASH_INTERPRET``: ``1`` always interprets, ``0`` always emits Mosaic (needed to
  compile for a TPU ahead of time on a host without one); unset or empty: Mosaic on TPU,
  the interpreter elsewhere.
  ``PALLAS_FLASH_DETECT_RACES``: ``1`` turns on the interpreter's race detector, which prints
  ``RACE DETECTED`` for every data race it sees.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.pallas import tpu as pltpu

INTERPRET_ENV_VAR = "PALLAS_FLASH_INTERPRET"
DETECT_RACES_ENV_VAR = "PALLAS_FLASH_DETECT_RACES"


def _flag(name: str) -> bool | None:
    """``True`` for ``1``, ``False`` for ``0``, ``None`` when unset or empty."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0, 1 or unset, got {value!r}")
    return None if value == "" else value == "1"


def interpret_params() -> pltpu.InterpretParams | None:
    """The ``interpret=`` argument of ``pl.pallas_call``: None for Mosaic, else the
    interpreter's settings.

    Raises:
      ValueError: an environment variable holds something other than 0, 1 or nothing.
    """
    interpret = _flag(INTERPRET_ENV_VAR)
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    detect_races = bool(_flag(DETECT_RACES_ENV_VAR))
    if not interpret:
        return None
    return pltpu.InterpretParams(detect_races=detect_races)
