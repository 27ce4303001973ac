"""Shared fixtures of the llama tests: 4 host CPU devices, tiny configs and directories, and
the server tests' model, fake engine, app and client (imported when a test asks for them:
they need the serve extra).

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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, object]:
    """The server tests' model: the tiny model with a chat template
    (`server_testing.chat_model`) and its config."""
    from server_testing import chat_model

    return chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def fake():
    """The server tests' engine (`server_testing.FakeEngine`), running."""
    from server_testing import FakeEngine

    from pallas_flash_llama.config import get_config

    engine = FakeEngine(get_config("tiny").max_len)
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def url(model_dir: tuple[pathlib.Path, object], fake) -> object:
    """The OpenAI-compatible app on ``fake`` serving ``model_dir`` as `server_testing.MODEL`,
    served on a free port: its URL."""
    from server_testing import MODEL, serving

    from pallas_flash_llama.server import make_app

    with serving(make_app(fake, *model_dir, model_name=MODEL)) as address:
        yield address


@pytest.fixture(scope="module")
def client(url: str):
    """The ``openai`` client of ``url``, no retries."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict]:
    """A tiny Hugging Face directory (`TINY_HF`) and its weights."""
    directory = tmp_path_factory.mktemp("hf-tiny")
    return directory, write_hf_dir(directory, TINY_HF)
