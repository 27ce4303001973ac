"""The TPU interpreter's race detector over the forward and backward kernels.

The detector reports ``RACE DETECTED`` (with the buffers and clocks) for every data race
between the simulated DMAs and the kernel body: jax 0.10 prints it and goes on, newer jax
raises it (the interpreter's ``on_race="raise"``). These tests check both ways: first that it
does report a race planted in a small kernel, then that the kernels, on calls that span
several blocks, chunks and GQA heads, report none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_flash as pf
from pallas_flash.interpret import (
    DETECT_RACES_ENV_VAR,
    INTERPRET_ENV_VAR,
    RACE_REPORT,
    interpret_params,
)
from pallas_flash_conformance import inputs
from pallas_flash_pallas import BlockSizes, flash_attention


@pytest.fixture(autouse=True)
def detect_races(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERPRET_ENV_VAR, "1")
    monkeypatch.setenv(DETECT_RACES_ENV_VAR, "1")


def test_a_planted_race_is_reported(capfd: pytest.CaptureFixture[str]) -> None:
    """A kernel that reads a DMA's destination before waiting for the DMA."""

    def kernel(x_hbm, o_ref, buffer, semaphore):
        copy = pltpu.make_async_copy(x_hbm, buffer, semaphore)
        copy.start()
        o_ref[...] = buffer[...]
        copy.wait()

    x = jnp.ones((8, 128), jnp.float32)
    racy = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA],
        interpret=interpret_params(),
    )
    try:
        jax.block_until_ready(racy(x))
    except jax.errors.JaxRuntimeError as error:  # raised from the interpreter's callback
        assert RACE_REPORT in str(error)
    else:
        assert RACE_REPORT in capfd.readouterr().out


@pytest.mark.parametrize(
    "blocks",
    [
        BlockSizes(256, 128, 128, 128, 256, 128),
        BlockSizes(256, 128, 128, 128, 128, 128, backward_chunk_blocks=1),
    ],
    ids=["one-chunk", "chunked"],
)
def test_forward_and_backward_have_no_races(
    capfd: pytest.CaptureFixture[str], blocks: BlockSizes
) -> None:
    q, k, v = inputs.qkv(1, 4, 2, 300, 300, 64)
    spec = pf.AttentionSpec(sm_scale=0.125, causal=True)
    out, vjp = jax.vjp(
        lambda q, k, v: flash_attention(q, k, v, None, None, None, spec, blocks), q, k, v
    )
    jax.block_until_ready((out, vjp(out)))
    assert RACE_REPORT not in capfd.readouterr().out
