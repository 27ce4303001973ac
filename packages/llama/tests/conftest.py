"""Shared fixtures of the llama tests: 4 host CPU devices, tiny configs and directories.

The sharding tests need 4 devices: the flag below is added before jax starts its CPU backend
(``scripts/nox`` runs these tests in their own pytest process for that reason).
"""

from __future__ import annotations

import os
import pathlib

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count=4"
if HOST_DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {HOST_DEVICES_FLAG}".strip()

import sys  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # llama_reference, llama_testing

import pytest  # noqa: E402
from llama_testing import TINY_HF, write_hf_dir  # noqa: E402


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict]:
    """A tiny Hugging Face directory (`TINY_HF`) and its weights."""
    directory = tmp_path_factory.mktemp("hf-tiny")
    return directory, write_hf_dir(directory, TINY_HF)
