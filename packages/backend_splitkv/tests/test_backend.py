"""The ``splitkv`` backend's registration and its mesh check (placement without a mesh:
`test_placement`)."""

from __future__ import annotations

import importlib.metadata

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
from pallas_flash_splitkv import DecodeBlocks, SplitKvBackend, split_kv_decode


def test_registered_as_the_tpu_decode_backend() -> None:
    info = {i.name: i for i in pf.list_backends()}["splitkv"]
    assert info.distribution == "pallas-flash-splitkv"
    assert importlib.metadata.version(info.distribution)
    assert info.platforms == {"tpu"} and info.priority == 100
    expected = {"decode", "gqa", "softcap", "paged_cache", "int8_cache", "multi_device"}
    assert info.capabilities == expected
    assert SplitKvBackend().blocks == DecodeBlocks()


def test_a_mesh_that_does_not_divide_the_cache_raises() -> None:
    mesh = jax.sharding.AbstractMesh((3,), ("kv",))  # the check needs no devices
    x = jnp.zeros((1, 2, 64))
    cache = jnp.zeros((1, 2, 100, 64))
    with pytest.raises(pf.InvalidInputError, match=r"k_cache: expected max_len divisible by"):
        split_kv_decode(
            x,
            pf.DecodeCache(cache, cache),
            jnp.array([5]),
            spec=pf.DecodeSpec(sm_scale=0.125),
            blocks=DecodeBlocks(),
            mesh=mesh,
        )


def test_a_paged_cache_over_several_devices_is_unsupported() -> None:
    mesh = jax.sharding.AbstractMesh((2,), ("kv",))
    pages = jnp.zeros((4, 2, 16, 64))
    with pytest.raises(pf.UnsupportedFeatureError, match="paged cache on one device"):
        split_kv_decode(
            jnp.zeros((1, 2, 64)),
            pf.DecodeCache(pages, pages, jnp.zeros((1, 2), jnp.int32)),
            jnp.array([5]),
            spec=pf.DecodeSpec(sm_scale=0.125),
            blocks=DecodeBlocks(),
            mesh=mesh,
        )
