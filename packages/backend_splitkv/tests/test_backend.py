"""The ``splitkv`` backend's registration, its default mesh and its mesh check."""

from __future__ import annotations

import importlib.metadata

import jax
import jax.numpy as jnp
import pytest
from pallas_flash_splitkv import DecodeBlocks, SplitKvBackend, split_kv_decode
from pallas_flash_splitkv.decode import default_mesh

import pallas_flash as pf


def test_registered_as_the_tpu_decode_backend() -> None:
    info = {i.name: i for i in pf.list_backends()}["splitkv"]
    assert info.distribution == "pallas-flash-splitkv"
    assert importlib.metadata.version(info.distribution)
    assert info.platforms == {"tpu"} and info.priority == 100
    assert info.capabilities == {"decode", "gqa", "softcap", "multi_device"}
    assert SplitKvBackend().blocks == DecodeBlocks()


def test_default_mesh_uses_every_local_device_that_divides_the_cache() -> None:
    devices = jax.local_devices()
    if len(devices) == 1:
        assert default_mesh(1024) is None
    else:
        assert default_mesh(1024 * len(devices)).size == len(devices)
        assert default_mesh(1024 * len(devices) + 1) is None


def test_a_mesh_that_does_not_divide_the_cache_raises() -> None:
    mesh = jax.sharding.AbstractMesh((3,), ("kv",))  # the check needs no devices
    x = jnp.zeros((1, 2, 64))
    cache = jnp.zeros((1, 2, 100, 64))
    with pytest.raises(pf.InvalidInputError, match=r"k_cache: expected max_len divisible by"):
        split_kv_decode(
            x,
            cache,
            cache,
            jnp.array([5]),
            spec=pf.DecodeSpec(sm_scale=0.125),
            blocks=DecodeBlocks(),
            mesh=mesh,
        )
