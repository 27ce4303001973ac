"""Entry point of the ``pallas_flash.backends`` group for the XLA backend."""

from __future__ import annotations

import pallas_flash as pf
from pallas_flash_xla.backend import XlaBackend


@pf.hookimpl
def pallas_flash_backends() -> list[pf.Backend]:
    """The XLA baseline backend."""
    return [XlaBackend()]
