"""A disk cache of compile results keyed by (subject and version, workload, topology, toolchain).

The key holds the whole job (subject id and version, workload, the target's topology) and the
versions of jax, jaxlib, libtpu, pallas-flash, the estimator's analysis
(``pallas_flash_estimate.ANALYSIS_VERSION``) and the bench's row format
(``runner.ROW_FORMAT``). Targets of one topology (v5e-1, v5e-4) share their results: the
workload says how many of its chips a call uses.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib


def default_dir() -> pathlib.Path:
    """``$XDG_CACHE_HOME/pallas-flash/bench`` (``~/.cache/...`` by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(root) / "pallas-flash" / "bench"


_NOT_KEYS = ("id", "sweep", "backends", "references", "target")


class ResultCache:
    """JSON files named by the hash of a job's key; ``directory=None`` disables caching."""

    def __init__(self, directory: pathlib.Path | None) -> None:
        self.directory = directory

    @staticmethod
    def key(job: dict, versions: dict[str, str | None]) -> str:
        # sweep, backends and references only tell the worker how to find the subject by id,
        # and the target's name which topology to compile for (the job's "topology")
        relevant = {k: v for k, v in job.items() if k not in _NOT_KEYS}
        payload = json.dumps([relevant, versions], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:32]

    def holds(self, key: str) -> bool:
        """Whether ``key``'s result is cached."""
        return self.directory is not None and (self.directory / f"{key}.json").exists()

    def get(self, key: str) -> dict | None:
        """The cached result (None: not cached, or cached as unsupported: `holds` tells)."""
        if self.directory is None:
            return None
        path = self.directory / f"{key}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def put(self, key: str, result: dict | None) -> None:
        """Caches ``result``; None (the subject does not support the workload) as JSON null."""
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"{key}.json").write_text(json.dumps(result))
