"""Entry point of the ``pallas_flash.backends`` group for the Split-KV backend."""

from __future__ import annotations

import pallas_flash as pf
from pallas_flash_splitkv.backend import SplitKvBackend


@pf.hookimpl
def pallas_flash_backends() -> list[pf.Backend]:
    """The Split-KV decoding backend with its default tiling."""
    return [SplitKvBackend()]
