"""Decode parity of ``pf.decode`` against the float64 reference."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, LARGE_LOGIT_TOLERANCE, assert_close

pytestmark = pytest.mark.requires("decode")

# name: (batch, q_heads, kv_heads, max_len, head_dim, lengths)
SHAPES = {
    "ragged-0-1-max": (4, 4, 4, 130, 64, [0, 1, 130, 77]),
    "len1-cache1": (1, 2, 2, 1, 64, [1]),
    "d96": (2, 2, 2, 64, 96, [64, 1]),
    "d256": (2, 2, 2, 64, 256, [33, 64]),
    "gqa4": (2, 8, 2, 256, 128, [256, 100]),
    "gqa8": (2, 16, 2, 96, 64, [5, 96]),
    "mqa-1000": (3, 8, 1, 1000, 128, [1000, 0, 999]),
}


# Caches whose length every device count up to 8 divides; with several devices the lengths
# leave some devices' slices of a sequence empty, or partly filled.
MESH_SHAPES = {
    "mha-ragged-0-max": (3, 4, 4, 512, 64, [0, 130, 512]),
    "gqa4": (2, 8, 2, 256, 128, [256, 65]),
    "gqa8-one-token": (2, 16, 2, 512, 64, [1, 300]),
    "mqa": (3, 8, 1, 1024, 128, [1024, 0, 700]),
}


def _params(shapes: dict = SHAPES) -> list:
    return [
        pytest.param(
            shape, id=name, marks=[pytest.mark.requires("gqa")] if shape[1] != shape[2] else []
        )
        for name, shape in shapes.items()
    ]


def _check(
    backend: str,
    shape,
    dtype: str,
    *,
    softcap=None,
    q_scale=1.0,
    jit=False,
    tolerance=FORWARD_TOLERANCE,
    mesh=None,
) -> np.ndarray:
    batch, q_heads, kv_heads, max_len, head_dim, lengths = shape
    q = inputs.normal(0, (batch, q_heads, head_dim), dtype, scale=q_scale)
    k_cache = inputs.normal(1, (batch, kv_heads, max_len, head_dim), dtype)
    v_cache = inputs.normal(2, (batch, kv_heads, max_len, head_dim), dtype)
    lengths = np.asarray(lengths, dtype=np.int32)

    def call(q, k_cache, v_cache, lengths):
        return pf.decode(q, k_cache, v_cache, lengths, softcap=softcap, backend=backend, mesh=mesh)

    out = (jax.jit(call) if jit else call)(q, k_cache, v_cache, lengths)
    expected = reference.decode(
        q, k_cache, v_cache, lengths, sm_scale=1 / math.sqrt(head_dim), softcap=softcap
    )
    assert out.dtype == q.dtype
    assert_close(out, expected, tolerance[dtype])
    return np.asarray(out, dtype=np.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", _params())
def test_decode(backend, shape, dtype: str) -> None:
    out = _check(backend.name, shape, dtype)
    for b, length in enumerate(shape[-1]):
        if length == 0:
            assert (out[b] == 0).all(), "a sequence with no cached token must give zeros"


@pytest.mark.requires("multi_device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", _params(MESH_SHAPES))
def test_decode_over_a_mesh(backend, shape, dtype: str) -> None:
    """The cache's sequence axis split over every device (one device: no split)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("kv",))
    out = _check(backend.name, shape, dtype, mesh=mesh)
    for b, length in enumerate(shape[-1]):
        if length == 0:
            assert (out[b] == 0).all(), "a sequence with no cached token must give zeros"


@pytest.mark.requires("multi_device")
def test_decode_over_a_mesh_under_jit(backend) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("kv",))
    _check(backend.name, MESH_SHAPES["mha-ragged-0-max"], "float32", jit=True, mesh=mesh)


def test_lengths_traced_under_jit(backend) -> None:
    _check(backend.name, SHAPES["ragged-0-1-max"], "float32", jit=True)


def test_traced_lengths_past_max_len_count_as_max_len(backend) -> None:
    """Traced lengths cannot be range-checked: past ``max_len`` they count as ``max_len``
    (nothing past the cache is read)."""
    batch, q_heads, kv_heads, max_len, head_dim, _ = SHAPES["ragged-0-1-max"]
    q = inputs.normal(0, (batch, q_heads, head_dim))
    k_cache, v_cache = (inputs.normal(s, (batch, kv_heads, max_len, head_dim)) for s in (1, 2))
    lengths = np.array([max_len + 1, 2 * max_len, 2**31 - 1, max_len], np.int32)
    out = jax.jit(lambda lengths: pf.decode(q, k_cache, v_cache, lengths, backend=backend.name))(
        lengths
    )
    expected = reference.decode(
        q, k_cache, v_cache, np.full(batch, max_len), sm_scale=1 / math.sqrt(head_dim)
    )
    assert_close(out, expected, FORWARD_TOLERANCE["float32"])


def test_all_lengths_zero(backend) -> None:
    out = _check(backend.name, (2, 2, 2, 64, 64, [0, 0]), "float32")
    assert (out == 0).all()


@pytest.mark.requires("softcap")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_softcap(backend, dtype: str) -> None:
    _check(backend.name, SHAPES["ragged-0-1-max"], dtype, softcap=1.5, q_scale=4.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_logits(backend, dtype: str) -> None:
    _check(
        backend.name,
        SHAPES["ragged-0-1-max"],
        dtype,
        q_scale=100.0,
        tolerance=LARGE_LOGIT_TOLERANCE,
    )


def test_stale_cache_slots_past_lengths_are_ignored(backend) -> None:
    """Cache slots at and past ``lengths[b]`` may hold anything, NaN included."""
    q = inputs.normal(0, (2, 2, 64))
    lengths = np.array([70, 1], np.int32)
    k_cache, v_cache = (np.array(inputs.normal(seed, (2, 2, 130, 64))) for seed in (1, 2))
    expected = reference.decode(q, k_cache, v_cache, lengths, sm_scale=1 / math.sqrt(64))
    for b, length in enumerate(lengths):
        k_cache[b, :, length:] = np.nan
        v_cache[b, :, length:] = np.nan
    out = pf.decode(q, k_cache, v_cache, lengths, backend=backend.name)
    assert_close(out, expected, FORWARD_TOLERANCE["float32"])


def _user_mesh(kind: str) -> jax.sharding.Mesh:
    """A mesh over every device as users build it: ``jax.make_mesh`` (the constructor jax's
    docs teach; its axes ``Explicit`` on this jax) or ``jax.sharding.Mesh`` (axes ``Auto``)."""
    if kind == "make_mesh":
        return jax.make_mesh((jax.device_count(),), ("kv",))
    return jax.sharding.Mesh(np.array(jax.devices()), ("kv",))


@pytest.mark.requires("multi_device")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("placed", ["numpy", "one_device", "sharded"])
@pytest.mark.parametrize("kind", ["make_mesh", "Mesh"])
def test_decode_takes_arrays_as_users_have_them(backend, kind: str, placed: str, jit: bool):
    """NumPy arrays, jax arrays on one device or a cache already split over the mesh: the
    same output, eager or jitted, over either kind of mesh (under the user's jit, jax refuses
    an argument committed to one device: there, on the default device uncommitted)."""
    mesh = _user_mesh(kind)
    batch, q_heads, kv_heads, max_len, head_dim, lengths = MESH_SHAPES["mha-ragged-0-max"]
    q = np.asarray(inputs.normal(0, (batch, q_heads, head_dim), "float32"))
    k_cache = np.asarray(inputs.normal(1, (batch, kv_heads, max_len, head_dim), "float32"))
    v_cache = np.asarray(inputs.normal(2, (batch, kv_heads, max_len, head_dim), "float32"))
    lengths = np.asarray(lengths, np.int32)
    args = [q, k_cache, v_cache, lengths]
    if placed == "one_device":  # committed to the last device (eager: under jit jax refuses)
        args = [jax.device_put(a, jax.devices()[-1]) if not jit else jnp.asarray(a)
                for a in args]  # fmt: skip
    elif placed == "sharded":
        split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "kv"))
        args[1:3] = [jax.device_put(a, split) for a in args[1:3]]

    def call(q, k_cache, v_cache, lengths):
        return pf.decode(q, k_cache, v_cache, lengths, backend=backend.name, mesh=mesh)

    out = (jax.jit(call) if jit else call)(*args)
    expected = reference.decode(q, k_cache, v_cache, lengths, sm_scale=1 / math.sqrt(head_dim))
    assert_close(out, expected, FORWARD_TOLERANCE["float32"])
