"""The engine's sampler compiled for v5e (libtpu, no TPU): `sampler_branches` finds its two
conditionals by what their branches hold, and each way of sampling runs the ops it should:
the vocabulary's sort only when a slot's filters reach past the candidates, the candidates'
top-k only when a slot draws."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_flash_bench.models import sampler_branches
from pallas_flash_estimate.aot.devices import libtpu_version, target_devices
from pallas_flash_estimate.evaluate import program_loops
from pallas_flash_estimate.read import hlo
from pallas_flash_estimate.targets import TARGETS
from pallas_flash_llama.sampling import sample_rows

VOCAB = 128256
"""Llama-3's."""

pytestmark = pytest.mark.skipif(libtpu_version() is None, reason="libtpu is not installed")


def _sampler(logits, key_data, temperature, top_k, top_p):
    return sample_rows(logits, jax.random.wrap_key_data(key_data), temperature, top_k, top_p)


@pytest.fixture(scope="module")
def compiled() -> str:
    device = target_devices(TARGETS["v5e-1"])[0]
    on_chip = jax.sharding.SingleDeviceSharding(device)
    rows = 16
    arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip)  # noqa: E731
    per_row = [arg((rows,), dtype) for dtype in (jnp.float32, jnp.int32, jnp.float32)]
    args = (arg((rows, VOCAB), jnp.float32), arg((rows, 2), jnp.uint32), *per_row)
    lowered = jax.jit(_sampler).trace(*args).lower(lowering_platforms=("tpu",))
    return lowered.compile().as_text()


def test_each_way_of_sampling_runs_its_own_ops(compiled: str) -> None:
    comps = hlo.parse_computations(compiled)
    sorts = {op.name: max(dims[-1] for _, dims, _ in hlo.arrays(op.shape))
             for comp in comps.values() for op in comp.ops if op.opcode == "sort"}  # fmt: skip
    vocab_sorts = [name for name, width in sorts.items() if width >= VOCAB]
    candidate_sorts = [name for name, width in sorts.items() if width < VOCAB]
    assert vocab_sorts and candidate_sorts
    conditionals = [op for comp in comps.values() for op in comp.ops if op.opcode == "conditional"]
    runs = {}
    for way in sampler_branches.SAMPLINGS:
        shares = sampler_branches.branch_shares(comps, VOCAB, way)
        assert all(shares(op) is not None for op in conditionals), "both are the sampler's"
        runs[way] = program_loops.program_runs(compiled, comps, shares).ops
    assert len(conditionals) == 2
    assert all(runs["sorted"][name] == 1 for name in vocab_sorts + candidate_sorts)
    assert all(runs["candidates"][name] == 0 for name in vocab_sorts)
    assert all(runs["candidates"][name] == 1 for name in candidate_sorts)
    assert all(runs["greedy"][name] == 0 for name in vocab_sorts + candidate_sorts)


def test_an_unknown_way_is_refused() -> None:
    with pytest.raises(ValueError, match="sampling: expected one of"):
        sampler_branches.branch_shares({}, VOCAB, "beam")
