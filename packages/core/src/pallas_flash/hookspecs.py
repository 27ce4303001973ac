"""The pluggy hook a backend plugin implements.

A plugin is any module or object with a ``pallas_flash_backends`` function marked with
`hookimpl`. Distributions advertise their plugin in the entry-point group
``pallas_flash.backends``::

    [project.entry-points."pallas_flash.backends"]
    xla = "pallas_flash_xla.plugin"
"""

from __future__ import annotations

from collections.abc import Sequence

import pluggy

from pallas_flash.backend import Backend

PROJECT_NAME = "pallas_flash"
ENTRY_POINT_GROUP = "pallas_flash.backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def pallas_flash_backends() -> Sequence[Backend]:  # type: ignore[empty-body]
    """Returns the backends this plugin provides."""
