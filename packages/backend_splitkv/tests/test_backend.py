"""The ``splitkv`` backend's registration and its mesh check (placement without a mesh:
`test_placement`)."""

from __future__ import annotations

import importlib.metadata

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
from pallas_flash_splitkv import DecodeBlocks, RaggedBlocks, SplitKvBackend, split_kv_decode


def test_registered_as_the_tpu_decode_backend() -> None:
    info = {i.name: i for i in pf.list_backends()}["splitkv"]
    assert info.distribution == "pallas-flash-splitkv"
    assert importlib.metadata.version(info.distribution)
    assert info.platforms == {"tpu"} and info.priority == 100
    expected = {"decode", "gqa", "softcap", "paged_cache", "int8_cache", "packed_cache"}
    expected |= {"multi_device"}
    expected |= {"ragged", "sliding_window", "sinks"}  # sliding_window and sinks: ragged only
    assert info.capabilities == expected
    assert SplitKvBackend().blocks == DecodeBlocks()
    assert SplitKvBackend().ragged_blocks == RaggedBlocks()


@pytest.mark.parametrize(
    ("cache", "table", "expected"),
    [
        ((1, 2, 100, 64), None, "max_len divisible by the mesh's 3 devices, got max_len=100"),
        ((4, 2, 16, 64), (1, 2), "num_pages divisible by the mesh's 3 devices, got num_pages=4"),
    ],
    ids=["contiguous", "paged"],
)
def test_a_mesh_that_does_not_divide_the_cache_raises(cache, table, expected) -> None:
    mesh = jax.sharding.AbstractMesh((3,), ("kv",))  # the check needs no devices
    cache = jnp.zeros(cache)
    table = None if table is None else jnp.zeros(table, jnp.int32)
    with pytest.raises(pf.InvalidInputError, match=rf"k_cache: expected {expected}"):
        split_kv_decode(
            jnp.zeros((1, 2, 64)),
            pf.DecodeCache(cache, cache, table),
            jnp.array([5]),
            spec=pf.DecodeSpec(sm_scale=0.125),
            blocks=DecodeBlocks(),
            mesh=mesh,
        )
