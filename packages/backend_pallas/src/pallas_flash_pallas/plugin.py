"""Entry point of the ``pallas_flash.backends`` group for the Pallas backend."""

from __future__ import annotations

import pallas_flash as pf
from pallas_flash_pallas.backend import PallasBackend


@pf.hookimpl
def pallas_flash_backends() -> list[pf.Backend]:
    """The Pallas kernel backend with its default block sizes."""
    return [PallasBackend()]
