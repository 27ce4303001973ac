"""Decoding and appending where the cache lives, with several local devices present.

With ``mesh=None`` a cache on one device is decoded on that device (no copy to the others), a
cache split along its sequence axis (a paged pool: along its pages) by a ``NamedSharding`` over
its mesh, and one split along another axis is refused. An append to a split cache moves no
data between devices.

The multi-device tests need 4 host devices, which must be set before jax initialises:
`test_on_four_host_devices` runs this file again in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (in a process that already has 4
devices they run directly).
"""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

import pallas_flash as pf
from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close
from pallas_flash_estimate.read import hlo_ops
from pallas_flash_splitkv import KVCache, PagedKVCache, placement
from pallas_flash_splitkv.cache import append_step
from pallas_flash_splitkv.paged_cache import _append_step

DEVICES = 4
HOST_DEVICES_FLAG = f"--xla_force_host_platform_device_count={DEVICES}"
four_devices = pytest.mark.skipif(
    jax.device_count() < DEVICES, reason=f"needs {DEVICES} devices (test_on_four_host_devices)"
)

BATCH, Q_HEADS, KV_HEADS, MAX_LEN, HEAD_DIM = 3, 4, 2, 512, 64
LENGTHS = [0, 130, 512]  # empty; ends inside the second of four slices; full


def _inputs() -> tuple[jax.Array, jax.Array, jax.Array, np.ndarray]:
    q = inputs.normal(0, (BATCH, Q_HEADS, HEAD_DIM))
    k = inputs.normal(1, (BATCH, KV_HEADS, MAX_LEN, HEAD_DIM))
    v = inputs.normal(2, (BATCH, KV_HEADS, MAX_LEN, HEAD_DIM))
    return q, k, v, np.asarray(LENGTHS, np.int32)


def _expected(q, k, v, lengths) -> np.ndarray:
    return reference.decode(q, k, v, lengths, sm_scale=1 / math.sqrt(HEAD_DIM))


def test_on_four_host_devices(tmp_path: pathlib.Path) -> None:
    if jax.device_count() >= DEVICES:
        pytest.skip("this process has the devices: the tests run here")
    flags = f"{os.environ.get('XLA_FLAGS', '')} {HOST_DEVICES_FLAG}".strip()
    report = tmp_path / "report.xml"
    others = ["-k", "not test_on_four_host_devices", "-p", "no:cacheprovider", __file__]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", f"--junitxml={report}", *others],
        env={**os.environ, "XLA_FLAGS": flags},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    cases = list(ET.parse(report).iter("testcase"))
    skipped = [case.get("name") for case in cases if case.find("skipped") is not None]
    assert cases and not skipped, skipped  # all ran, on 4 devices


def test_an_unplaced_or_traced_cache_stays_on_one_device() -> None:
    def check(cache: jax.Array) -> jax.Array:
        assert placement.follow(cache, cache) is None
        return cache

    cache = jnp.zeros((1, 1, 8, 64))
    check(cache)
    jax.jit(check)(cache)  # under jit its placement is unknown: one device


@four_devices
def test_a_cache_committed_to_one_device_is_decoded_there() -> None:
    device = jax.devices()[2]
    q, k, v, lengths = (jax.device_put(x, device) for x in _inputs())
    with jax.transfer_guard_device_to_device("disallow"):  # no copy to another device
        out = pf.decode(q, k, v, lengths, backend="splitkv")
        assert out.sharding == SingleDeviceSharding(device)
    assert_close(out, _expected(*_inputs()), FORWARD_TOLERANCE["float32"])


@four_devices
def test_append_to_a_cache_committed_to_one_device_stays_there() -> None:
    device = jax.devices()[2]
    sharding = SingleDeviceSharding(device)
    cache = KVCache.empty(2, KV_HEADS, 16, HEAD_DIM, jnp.float32, sharding=sharding)
    k_new, v_new = (inputs.normal(seed, (2, KV_HEADS, HEAD_DIM)) for seed in (3, 4))
    cache = cache.append(k_new, v_new)
    assert cache.k.sharding == cache.v.sharding == sharding
    np.testing.assert_array_equal(cache.k[:, :, 0], k_new)


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(jax.devices()[: math.prod(shape)]).reshape(shape), names)


@four_devices
@pytest.mark.parametrize(
    ("shape", "names", "spec", "axes"),
    [
        ((4,), ("kv",), PartitionSpec(None, None, "kv"), ("kv",)),
        ((2, 2), ("data", "kv"), PartitionSpec(None, None, "kv", None), ("kv",)),
        ((2, 2), ("x", "y"), PartitionSpec(None, None, ("x", "y")), ("x", "y")),
        ((4,), ("kv",), PartitionSpec(), ()),
    ],
    ids=["sequence-over-4", "sequence-over-2-of-2x2", "sequence-over-2x2", "replicated"],
)
def test_a_cache_sharded_along_its_sequence_is_decoded_over_its_mesh(
    shape: tuple[int, ...], names: tuple[str, ...], spec: PartitionSpec, axes: tuple[str, ...]
) -> None:
    mesh = _mesh(shape, names)
    q, k, v, lengths = _inputs()
    k, v = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (k, v))
    assert placement.follow(k, v) == (mesh, axes)
    out = pf.decode(q, k, v, lengths, backend="splitkv")
    assert out.sharding.mesh == mesh
    assert_close(out, _expected(*_inputs()), FORWARD_TOLERANCE["float32"])


@four_devices
@pytest.mark.parametrize(
    "spec", [PartitionSpec("kv"), PartitionSpec(None, "kv"), PartitionSpec(None, None, None, "kv")]
)
def test_a_cache_sharded_along_another_axis_raises(spec: PartitionSpec) -> None:
    mesh = _mesh((2,), ("kv",))
    q, k, v, lengths = _inputs()
    k, v = (jax.device_put(x[:2], NamedSharding(mesh, spec)) for x in (k, v))
    with pytest.raises(pf.InvalidInputError, match=r"k_cache: expected a cache on one device"):
        pf.decode(q[:2], k, v, lengths[:2], backend="splitkv")


@four_devices
def test_k_and_v_placed_differently_raise() -> None:
    q, k, v, lengths = _inputs()
    k = jax.device_put(k, NamedSharding(_mesh((4,), ("kv",)), PartitionSpec(None, None, "kv")))
    with pytest.raises(pf.InvalidInputError, match=r"v_cache: expected the placement of k_cache"):
        pf.decode(q, k, jax.device_put(v, jax.devices()[1]), lengths, backend="splitkv")


@four_devices
def test_append_to_a_sequence_split_cache_stays_on_each_device() -> None:
    """Each device writes only the positions in its own slice: the compiled append has no
    collective, and the result equals a one-device append (a full sequence left unchanged)."""
    mesh = _mesh((4,), ("kv",))
    sharding = NamedSharding(mesh, PartitionSpec(None, None, "kv"))
    k_new, v_new = (inputs.normal(seed, (4, KV_HEADS, HEAD_DIM)) for seed in (3, 4))

    def cache(lengths: list[int], sharding: jax.sharding.Sharding | None) -> KVCache:
        empty = KVCache.empty(4, KV_HEADS, MAX_LEN, HEAD_DIM, jnp.float32, sharding=sharding)
        return KVCache(empty.k, empty.v, jnp.asarray(lengths, jnp.int32))

    full = [0, 127, 128, 512]  # slice edges; a full sequence
    step = append_step(pf.cache_format(sharding), None, (mesh, ("kv",)))
    compiled = step.lower(cache(full, sharding), k_new, v_new).compile()
    assert not hlo_ops.collectives(compiled.as_text())
    split, one = (
        compiled(cache(full, sharding), k_new, v_new),
        append_step(None, None, None)(cache(full, None), k_new, v_new),
    )
    np.testing.assert_array_equal(split.lengths, [1, 128, 129, 512])
    for got, expected in ((split.k, one.k), (split.v, one.v)):
        np.testing.assert_array_equal(got, expected)

    lengths = [0, 127, 128, 511]
    split = cache(lengths, sharding).append(k_new, v_new)
    one = cache(lengths, None).append(k_new, v_new)
    assert split.k.sharding == sharding and split.v.sharding == sharding
    np.testing.assert_array_equal(split.k, one.k)
    np.testing.assert_array_equal(split.v, one.v)


@four_devices
def test_an_int8_sequence_split_cache_appends_locally_and_decodes_over_its_mesh() -> None:
    mesh = _mesh((4,), ("kv",))
    sharding = NamedSharding(mesh, PartitionSpec(None, None, "kv"))
    q = inputs.normal(0, (4, Q_HEADS, HEAD_DIM))
    caches = [
        KVCache.empty(4, KV_HEADS, MAX_LEN, HEAD_DIM, jnp.int8, sharding=s)
        for s in (sharding, None)
    ]
    assert caches[0].k_scales.sharding.spec == PartitionSpec(None, None, "kv")
    for step in range(3):
        k_new, v_new = (inputs.normal(10 * step + s, (4, KV_HEADS, HEAD_DIM)) for s in (0, 1))
        caches = [c.append(k_new, v_new) for c in caches]
    split, one = caches
    for name in ("k", "v", "k_scales", "v_scales"):
        np.testing.assert_array_equal(getattr(split, name), getattr(one, name))
    out = split.decode(q, backend="splitkv")
    assert out.sharding.mesh == mesh
    assert_close(out, np.asarray(one.decode(q, backend="xla"), np.float64), 1e-5)


@four_devices
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8], ids=["float32", "int8"])
def test_a_paged_cache_split_over_a_mesh_spreads_each_sequence_over_it(dtype) -> None:
    """A pool split along its pages: page ``j`` of sequence ``b`` comes from shard ``(j + b) %
    4``, appends write locally (no collective), decode follows the pool's mesh and equals the
    one-device cache's, and release returns each page to its shard."""
    mesh = _mesh((4,), ("kv",))
    sharding = NamedSharding(mesh, PartitionSpec("kv"))
    page_size, per_shard, lengths = 4, 6, np.array([0, 5, 21])
    split, one = (
        PagedKVCache.empty(3, 6, 4 * per_shard, KV_HEADS, page_size, HEAD_DIM, dtype, sharding=s)
        for s in (sharding, None)
    )
    assert split.shards == 4 and split.k.sharding == sharding
    k_new, v_new = (inputs.normal(seed, (3, KV_HEADS, HEAD_DIM)) for seed in (3, 4))
    active = jnp.asarray(lengths > 0)
    step = _append_step(pf.kept_format(split.k), None if dtype == jnp.float32 else
                        pf.kept_format(split.k_scales), (mesh, ("kv",)))  # fmt: skip
    assert not hlo_ops.collectives(step.lower(split, k_new, v_new, active).compile().as_text())
    for position in range(int(lengths.max())):
        k_new, v_new = (inputs.normal(10 * position + s, (3, KV_HEADS, HEAD_DIM)) for s in (0, 1))
        active = jnp.asarray(position < lengths)
        split, one = split.append(k_new, v_new, active), one.append(k_new, v_new, active)
    np.testing.assert_array_equal(split.lengths, lengths)
    table = np.asarray(split.page_table)
    for b, length in enumerate(lengths):
        shards = table[b, : math.ceil(length / page_size)] // per_shard
        np.testing.assert_array_equal(shards, (np.arange(len(shards)) + b) % 4)
    q = inputs.normal(0, (3, Q_HEADS, HEAD_DIM))
    out = split.decode(q, backend="splitkv")
    assert out.sharding.mesh == mesh
    assert_close(out, np.asarray(one.decode(q, backend="xla"), np.float64), 1e-5)
    held = np.asarray(split.num_free) + np.bincount((np.arange(6) + 2) % 4, minlength=4)
    freed = split.release(np.array([False, False, True]))  # donates split
    np.testing.assert_array_equal(freed.num_free, held)
