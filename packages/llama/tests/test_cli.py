"""The ``pallas-flash-llama`` commands, end to end on the tiny model (in this process)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pallas_flash_llama.cli import main
from pallas_flash_llama.weights import load_params

OFF = ["--compilation-cache", "off"]


def _train_tiny(model, *, batch_size: int, seq_len: int) -> list[str]:
    """``train`` arguments for the tiny model on its sample text, on the xla backend."""
    data = str(model / "sample.txt")
    sizes = ["--batch-size", str(batch_size), "--seq-len", str(seq_len)]
    return ["train", "--model", str(model), "--data", data, *sizes, "--backend", "xla"]


def test_init_tiny_generate_train_and_generate_again(tmp_path, capsys) -> None:
    model = tmp_path / "tiny"
    assert main([*OFF, "init-tiny", str(model)]) == 0
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
        "sample.txt",
    ):
        assert (model / name).exists(), name
    prompt = ["--prompt", "The quick brown"]
    assert (
        main(
            [
                *OFF,
                "generate",
                "--model",
                str(model),
                *prompt,
                "--backend",
                "xla",
                "--max-new-tokens",
                "4",
                "--kv-cache",
                "paged",
                "--kv-dtype",
                "int8",
                "--page-size",
                "8",
            ]
        )
        == 0
    )
    trained = tmp_path / "trained"
    args = [*_train_tiny(model, batch_size=4, seq_len=64), "--steps", "30", "--lr", "3e-3",
            "--save", str(trained)]  # fmt: skip
    assert main([*OFF, *args]) == 0
    assert load_params(trained)[0] == load_params(model)[0]
    capsys.readouterr()
    assert (
        main(
            [
                *OFF,
                "generate",
                "--model",
                str(trained),
                *prompt,
                "--prompt",
                "Once upon",
                "--backend",
                "xla",
                "--max-new-tokens",
                "6",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # 30 steps on the sample text are enough for the tiny model to continue it
    assert "'The quick brown' -> ' fox jumps over" in out, out
    int8 = ["generate", "--model", str(trained), *prompt, "--backend", "xla", "--max-new-tokens",
            "6", "--weights", "int8"]  # fmt: skip
    assert main([*OFF, *int8]) == 0
    assert capsys.readouterr().out.startswith(" fox jumps over"), "int8 weights continue it too"


def test_a_resumed_training_run_equals_one_that_never_stopped(tmp_path, capsys) -> None:
    model = tmp_path / "tiny"
    assert main([*OFF, "init-tiny", str(model)]) == 0
    checkpoints = tmp_path / "checkpoints"
    args = [*OFF, *_train_tiny(model, batch_size=2, seq_len=32)]
    resumable = [*args, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2"]
    assert main([*args, "--steps", "4", "--save", str(tmp_path / "straight")]) == 0
    assert main([*resumable, "--steps", "3"]) == 0  # checkpoints at steps 2 and 3 (the end)
    assert sorted(int(p.name) for p in checkpoints.iterdir()) == [2, 3]
    capsys.readouterr()
    assert main([*resumable, "--steps", "4", "--save", str(tmp_path / "resumed")]) == 0
    assert "resuming at step 3" in capsys.readouterr().out
    assert sorted(int(p.name) for p in checkpoints.iterdir()) == [2, 3, 4]
    straight, resumed = load_params(tmp_path / "straight")[1], load_params(tmp_path / "resumed")[1]
    for got, expected in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(got, expected)
    assert main([*resumable, "--steps", "5", "--checkpoint-every", "0"]) == 2
    assert "--checkpoint-every: expected at least 1" in capsys.readouterr().err


def test_errors_exit_with_a_message(tmp_path, capsys) -> None:
    assert main([*OFF, "generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "config.json" in capsys.readouterr().err
    args = ["train", "--config", "llama-9", "--tokenizer", str(tmp_path), "--data", "x.txt"]
    assert main([*OFF, *args]) == 2
    assert "llama-9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--model", "a", "--config", "tiny", "--data", "x"])
