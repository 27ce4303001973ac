"""The model sharded over 4 host CPU devices computes what it computes on one."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_llama import generation as gen
from pallas_flash_llama import model
from pallas_flash_llama.config import get_config
from pallas_flash_llama.kv_cache import init_cache
from pallas_flash_llama.sharding import check_mesh, make_mesh
from pallas_flash_llama.train import TrainConfig, init_state, make_train_step, shard_batch

pytestmark = pytest.mark.skipif(
    jax.device_count() < 4, reason="needs 4 devices (XLA_FLAGS set by conftest before jax)"
)

CONFIG = get_config("tiny").replace(dtype="float32")
SEGMENTS = np.array([[1] * 10 + [2] * 22] * 4, np.int32)
TOKENS = np.random.default_rng(0).integers(0, CONFIG.vocab, (4, 32)).astype(np.int32)


def _mesh(data: int, fsdp: int, tensor: int):
    return make_mesh(data, fsdp, tensor, devices=jax.devices()[:4])


@pytest.mark.parametrize(
    ("backend", "sizes"),
    # the rules on every mesh shape with xla; the pallas kernels (slow in the interpreter)
    # under shard_map on the mesh that splits both the batch and the heads
    [("xla", (1, 2, 2)), ("xla", (2, 1, 2)), ("xla", (1, 4, 1)), ("pallas", (1, 2, 2))],
)
def test_sharded_forward_equals_unsharded(backend: str, sizes) -> None:
    mesh = _mesh(*sizes)
    params = model.init_params(CONFIG, jax.random.key(0))
    sharded = model.init_params(CONFIG, jax.random.key(0), mesh=mesh)

    def run(p, mesh):
        return jax.jit(
            lambda p, t, s: model.forward(p, t, CONFIG, segment_ids=s, backend=backend, mesh=mesh)
        )(p, TOKENS, SEGMENTS)

    np.testing.assert_allclose(run(sharded, mesh), run(params, None), rtol=1e-5, atol=1e-5)


def test_sharded_training_equals_unsharded() -> None:
    mesh = _mesh(1, 2, 2)
    train_config = TrainConfig(learning_rate=3e-3, warmup_steps=1, total_steps=5)
    batch = {"tokens": TOKENS, "segment_ids": SEGMENTS}
    states = {
        None: init_state(model.init_params(CONFIG, jax.random.key(0)), train_config),
        mesh: init_state(model.init_params(CONFIG, jax.random.key(0), mesh=mesh), train_config),
    }
    losses = {}
    for where, state in states.items():
        step = make_train_step(CONFIG, train_config, backend="xla", mesh=where)
        losses[where] = []
        for _ in range(3):
            state, metrics = step(state, shard_batch(batch, where))
            losses[where].append(float(metrics["loss"]))
        states[where] = state
    np.testing.assert_allclose(losses[mesh], losses[None], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(states[mesh]), jax.tree.leaves(states[None]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    wq = states[mesh].params["layers"]["wq"]
    want = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "fsdp", "tensor"))
    assert wq.sharding.is_equivalent_to(want, wq.ndim), wq.sharding


@pytest.mark.parametrize(
    ("split", "sizes", "kv_dtype"),
    [("sequence", (1, 4, 1), None), ("heads", (1, 2, 2), None), ("heads", (2, 1, 2), "int8")],
)
def test_generation_with_the_cache_split_over_the_mesh_equals_one_device(
    split, sizes, kv_dtype
) -> None:
    """Split along the sequence, each device's partials are merged across devices; split over
    batch and kv heads, each device decodes its own sequences and heads: both give one
    device's tokens."""
    mesh = _mesh(*sizes)
    prompts = [[1, 5, 9, 33], [1, 7], [1, 3, 4, 5, 6, 7, 8], [1, 2, 3]]
    kwargs = dict(max_new_tokens=5, stop_tokens=[], backend="xla", kv_dtype=kv_dtype)
    want = gen.generate_all(
        model.init_params(CONFIG, jax.random.key(0)),
        CONFIG,
        prompts,
        decode_backend="xla",
        **kwargs,
    )
    got = gen.generate_all(
        model.init_params(CONFIG, jax.random.key(0), mesh=mesh),
        CONFIG,
        prompts,
        decode_backend="splitkv",
        mesh=mesh,
        kv_split=split,
        **kwargs,
    )
    assert got == want
    cache = init_cache(CONFIG, len(prompts), 128, mesh, kv_dtype=kv_dtype, split=split)
    data, fsdp, tensor = sizes
    want_shard = {
        "sequence": (4, CONFIG.kv_heads, 128 // 4, CONFIG.head_dim),
        "heads": (4 // (data * fsdp), CONFIG.kv_heads // tensor, 128, CONFIG.head_dim),
    }[split]
    assert cache.k[0].sharding.shard_shape(cache.k[0].shape) == want_shard
    assert cache.split == split


@pytest.mark.parametrize(
    "sizes, batch, message",
    [((1, 1, 4), None, "kv_heads=2"), ((1, 4, 1), 6, "batch=6"), ((4, 1, 1), 2, "batch=2")],
)
def test_a_mesh_that_does_not_divide_is_named(sizes, batch, message) -> None:
    with pytest.raises(pf.InvalidInputError, match=message):
        check_mesh(CONFIG, _mesh(*sizes), batch=batch)


def test_bad_mesh_sizes_are_named() -> None:
    with pytest.raises(pf.InvalidInputError, match="product"):
        make_mesh(3, 1, 1, devices=jax.devices()[:4])
    with pytest.raises(pf.InvalidInputError, match="-1"):
        make_mesh(-1, -1, 1)
    with pytest.raises(pf.InvalidInputError, match="data x fsdp"):
        shard_batch({"tokens": TOKENS[:3], "segment_ids": SEGMENTS[:3]}, _mesh(1, 2, 2))
