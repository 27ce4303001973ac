"""Ahead-of-time compilation of the forward kernel for a TPU v5e by the real Mosaic compiler.

No TPU is needed, only libtpu (the compiler); without it these tests are skipped. Each program
must hold exactly one kernel and nothing that re-lays-out its inputs (copy, transpose, pad; a
copy that only prefetches an input into VMEM is allowed), and its temporary HBM must stay
small (no score-sized arrays).

Layouts: at a jit boundary XLA picks each argument's layout from its shape alone, e.g.
sequence-minor for a minor dimension below 128 (head_dim 64 or 96) or heads-before-sequence
for a sequence length that tiles badly, and must then relay it out for the kernel, which reads
row-major arrays. Inside a model XLA makes the producers write the layout the kernel asks for.
The tests pin row-major layouts to compile that situation; one case keeps XLA's defaults.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import SingleDeviceSharding

import pallas_flash as pf
from pallas_flash_bench import hlo
from pallas_flash_pallas.interpret import INTERPRET_ENV_VAR

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu (the TPU compiler) is not installed"
)

MAX_TEMP_BYTES = 1 << 20
"""Temporary HBM allowed: far below one head's ``N x N`` float32 scores at N=1000 (4 MB)."""


@pytest.fixture(scope="module")
def v5e() -> jax.Device:
    """The first chip of a v5e 2x2 topology (no hardware needed)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="tpu",
        topology_name="v5e:2x2",
        chip_config_name="default",
        chips_per_host_bounds=(2, 2, 1),
        num_slices=1,
    )
    return topology.devices[0]


@pytest.fixture(autouse=True)
def mosaic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Emit Mosaic kernels although the host is not a TPU."""
    monkeypatch.setenv(INTERPRET_ENV_VAR, "0")


def _compile(
    device: jax.Device,
    shapes: list[tuple[int, ...]],
    dtype: jnp.dtype,
    *,
    row_major: bool = True,
    **kwargs,
) -> jax.stages.Compiled:
    """Compiles ``pf.attention(q, k, v, **kwargs)`` for arrays of ``shapes`` (q, k, v, ...)."""
    sharding = SingleDeviceSharding(device)
    if row_major:
        sharding = Format(Layout(major_to_minor=(0, 1, 2, 3)), sharding)
    structs = [jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in shapes]

    def attention(q, k, v):
        return pf.attention(q, k, v, backend="pallas", **kwargs)

    jitted = jax.jit(attention, out_shardings=sharding)
    return jitted.trace(*structs).lower(lowering_platforms=("tpu",)).compile()


def _check(compiled: jax.stages.Compiled) -> None:
    text = compiled.as_text()
    assert len(hlo.kernel_calls(text)) == 1
    assert text.count('custom_call_target="tpu_custom_call"') == 1
    relayouts = [op for op in hlo.find_copy_trap(text) if op.relayout is not False]
    assert not relayouts, f"data is copied, transposed or padded: {relayouts}"
    memory = compiled.memory_analysis()
    assert memory.temp_size_in_bytes <= MAX_TEMP_BYTES, memory


CASES = {
    # name: (batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, pf.attention kwargs)
    "n4096": (1, 16, 16, 4096, 4096, 128, jnp.bfloat16, {}),
    "n4096-causal": (1, 16, 16, 4096, 4096, 128, jnp.bfloat16, {"causal": True}),
    "gqa-16-4-causal": (1, 16, 4, 4096, 4096, 128, jnp.bfloat16, {"causal": True}),
    "d64": (2, 8, 8, 2048, 2048, 64, jnp.bfloat16, {}),
    "d256": (2, 8, 8, 2048, 2048, 256, jnp.bfloat16, {}),
    "n1000": (1, 4, 4, 1000, 1000, 128, jnp.bfloat16, {}),
    "n1000-causal-gqa-d96-f32": (1, 4, 2, 1000, 1000, 96, jnp.float32, {"causal": True}),
    "window-softcap-q-short": (
        1,
        8,
        2,
        700,
        3000,
        128,
        jnp.bfloat16,
        {"sliding_window": (256, 0), "causal": True, "softcap": 30.0},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_compiles_to_one_kernel_without_copies(v5e: jax.Device, name: str) -> None:
    batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, kwargs = CASES[name]
    kv_shape = (batch, kv_heads, kv_len, head_dim)
    _check(_compile(v5e, [(batch, q_heads, q_len, head_dim), kv_shape, kv_shape], dtype, **kwargs))


def test_default_layouts_need_no_copy(v5e: jax.Device) -> None:
    """With head_dim 128 and aligned lengths XLA's default layouts are already row-major."""
    shape = (1, 16, 4096, 128)
    _check(_compile(v5e, [shape] * 3, jnp.bfloat16, row_major=False, causal=True))


def test_segment_ids_need_no_copy(v5e: jax.Device) -> None:
    """Segment ids reach the kernel as ``[batch, 1, len]`` views of ``[batch, len]``."""
    sharding = SingleDeviceSharding(v5e)
    qkv = jax.ShapeDtypeStruct((2, 4, 1024, 128), jnp.bfloat16, sharding=sharding)
    ids = jax.ShapeDtypeStruct((2, 1024), jnp.int32, sharding=sharding)

    def attention(q, k, v, q_ids, kv_ids):
        return pf.attention(q, k, v, segment_ids=pf.SegmentIds(q_ids, kv_ids), backend="pallas")

    lowered = jax.jit(attention).trace(qkv, qkv, qkv, ids, ids).lower(lowering_platforms=("tpu",))
    _check(lowered.compile())
