"""The TPU interpreter's race detector over the forward and backward kernels.

The detector reports ``RACE DETECTED`` (with the buffers and clocks) for every data race
between the simulated DMAs and the kernel body: jax 0.10 prints it, sets its kernel's
``races_found`` and goes on (read here through `interpret.recorded_races`), newer jax raises it (the
interpreter's ``on_race="raise"``). These tests check both ways: first that it does report a
race planted in a small kernel, then that the kernels, on calls that span several blocks,
chunks and GQA heads, report none.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
    recorded_races,
)
from pallas_flash_conformance import inputs
from pallas_flash_pallas import BlockSizes, flash_attention


@pytest.fixture(autouse=True)
def races(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The race detector's state of each kernel the test runs (`interpret.recorded_races`)."""
    monkeypatch.setenv(INTERPRET_ENV_VAR, "1")
    monkeypatch.setenv(DETECT_RACES_ENV_VAR, "1")
    with recorded_races() as states:
        yield states


def test_a_planted_race_is_reported(races: list[Any]) -> None:
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
        pltpu.reset_tpu_interpret_mode_state()  # jax keeps a failed kernel's state otherwise
        assert RACE_REPORT in str(error)
    else:
        assert [state.races_found for state in races] == [True]


@pytest.mark.parametrize(
    "blocks",
    [
        BlockSizes(256, 128, 128, 128, 256, 128),
        BlockSizes(256, 128, 128, 128, 128, 128, backward_chunk_blocks=1),
    ],
    ids=["one-chunk", "chunked"],
)
def test_forward_and_backward_have_no_races(races: list[Any], blocks: BlockSizes) -> None:
    q, k, v = inputs.qkv(1, 4, 2, 300, 300, 64)
    spec = pf.AttentionSpec(sm_scale=0.125, causal=True)
    out, vjp = jax.vjp(
        lambda q, k, v: flash_attention(q, k, v, None, None, None, spec, blocks), q, k, v
    )
    jax.block_until_ready((out, vjp(out)))
    assert len(races) >= 2 and not any(state.races_found for state in races)  # forward, backward
