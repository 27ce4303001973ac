"""The choice between Mosaic and the TPU interpreter, made at trace time from the environment."""

from __future__ import annotations

import jax
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_flash.interpret import DETECT_RACES_ENV_VAR, INTERPRET_ENV_VAR, interpret_params


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERPRET_ENV_VAR, raising=False)
    monkeypatch.delenv(DETECT_RACES_ENV_VAR, raising=False)


def test_default_follows_the_platform() -> None:
    params = interpret_params()
    if jax.default_backend() == "tpu":
        assert params is None
    else:
        assert params == pltpu.InterpretParams()


@pytest.mark.parametrize(("value", "mosaic"), [("0", True), ("1", False), ("", None)])
def test_environment_forces_the_choice(
    monkeypatch: pytest.MonkeyPatch, value: str, mosaic: bool | None
) -> None:
    monkeypatch.setenv(INTERPRET_ENV_VAR, value)
    if mosaic is None:
        mosaic = jax.default_backend() == "tpu"
    assert (interpret_params() is None) == mosaic


def test_race_detector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERPRET_ENV_VAR, "1")
    monkeypatch.setenv(DETECT_RACES_ENV_VAR, "1")
    assert interpret_params() == pltpu.InterpretParams(detect_races=True)


@pytest.mark.parametrize("name", [INTERPRET_ENV_VAR, DETECT_RACES_ENV_VAR])
def test_bad_value_raises(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=f"{name} must be 0, 1 or unset"):
        interpret_params()
