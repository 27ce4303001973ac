"""Ahead-of-time compilation of the forward and backward kernels for a TPU v5e by the real
Mosaic compiler.

No TPU is needed, only libtpu (the compiler); without it these tests are skipped. Each program
must hold exactly its kernels (the forward; for gradients the forward and the backward) and
nothing that re-lays-out their inputs (copy, transpose, pad; a copy that only prefetches an
input into VMEM is allowed), and its temporary HBM must stay small: no score-sized arrays; for
gradients only the output and the per-row statistics.

Layouts: at a jit boundary XLA picks each argument's layout from its shape alone, e.g.
sequence-minor for a minor dimension below 128 (head_dim 64 or 96) or heads-before-sequence
for a sequence length that tiles badly, and must then relay it out for the kernel, which reads
row-major arrays. Inside a model XLA makes the producers write the layout the kernel asks for.
The tests pin row-major layouts to compile that situation; one case keeps XLA's defaults.
"""

from __future__ import annotations

import importlib.util
import math

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import SingleDeviceSharding

import pallas_flash as pf
from pallas_flash import tpu
from pallas_flash.interpret import INTERPRET_ENV_VAR
from pallas_flash_estimate.aot.devices import target_devices
from pallas_flash_estimate.read import hlo_ops
from pallas_flash_estimate.targets import TARGETS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu (the TPU compiler) is not installed"
)

MAX_TEMP_BYTES = 1 << 20
"""Temporary HBM allowed: far below one head's ``N x N`` float32 scores at N=1000 (4 MB)."""


@pytest.fixture(scope="module")
def v5e() -> jax.Device:
    """The first chip of a v5e 2x2 topology (no hardware needed)."""
    return target_devices(TARGETS["v5e-1"])[0]


@pytest.fixture(autouse=True)
def mosaic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Emit Mosaic kernels although the host is not a TPU."""
    monkeypatch.setenv(INTERPRET_ENV_VAR, "0")


def _compile(
    device: jax.Device,
    shapes: list[tuple[int, ...]],
    dtype: jnp.dtype,
    *,
    grad: bool = False,
    row_major: bool = True,
    backend: str = "pallas",
    **kwargs,
) -> jax.stages.Compiled:
    """Compiles ``pf.attention(q, k, v, **kwargs)`` for arrays of ``shapes`` (q, k, v), or
    with ``grad`` its VJP ``(q, k, v, d_out) -> (dq, dk, dv)``."""
    sharding = SingleDeviceSharding(device)
    if row_major:
        sharding = Format(Layout(major_to_minor=(0, 1, 2, 3)), sharding)
    if grad:  # d_out: q's rows, v's head_dim
        shapes = [*shapes, (*shapes[0][:-1], shapes[2][-1])]
    structs = [jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in shapes]

    def attention(q, k, v):
        return pf.attention(q, k, v, backend=backend, **kwargs)

    def gradients(q, k, v, d_out):
        _, vjp = jax.vjp(attention, q, k, v)
        return vjp(d_out)

    jitted = jax.jit(gradients if grad else attention, out_shardings=sharding)
    return jitted.trace(*structs).lower(lowering_platforms=("tpu",)).compile()


def _check(compiled: jax.stages.Compiled, grad_of: jax.ShapeDtypeStruct | None = None) -> None:
    """Checks the program's kernels, copies and temporary HBM; ``grad_of``: q, when the
    program computes gradients."""
    text = compiled.as_text()
    kernels = ["pallas_flash_forward"] + (["pallas_flash_backward"] if grad_of else [])
    assert [call.name.split(".")[0] for call in hlo_ops.kernel_calls(text)] == kernels
    assert text.count('custom_call_target="tpu_custom_call"') == len(kernels)
    relayouts = [op for op in hlo_ops.find_copy_trap(text) if op.relayout is not False]
    assert not relayouts, f"data is copied, transposed or padded: {relayouts}"
    memory = compiled.memory_analysis()
    allowed = MAX_TEMP_BYTES
    if grad_of is not None:  # the forward's output, its log-sum-exp and the backward's row sums
        out_bytes = math.prod(grad_of.shape) * grad_of.dtype.itemsize
        allowed += out_bytes + 2 * 4 * math.prod(grad_of.shape[:-1])
    assert memory.temp_size_in_bytes <= allowed, memory


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


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradients"])
@pytest.mark.parametrize("name", list(CASES))
def test_compiles_to_its_kernels_without_copies(v5e: jax.Device, name: str, grad: bool) -> None:
    batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, kwargs = CASES[name]
    q_shape, kv_shape = (batch, q_heads, q_len, head_dim), (batch, kv_heads, kv_len, head_dim)
    compiled = _compile(v5e, [q_shape, kv_shape, kv_shape], dtype, grad=grad, **kwargs)
    _check(compiled, jax.ShapeDtypeStruct(q_shape, dtype) if grad else None)


def test_mla_head_dims_compile_to_their_kernels(v5e: jax.Device) -> None:
    """DeepSeek's MLA shape: q and k with head_dim 192, v with 128, causal, 8k tokens. The
    gradients' program: its forward kernel is a forward-only call's with the log-sum-exp
    written too (both are `forward._forward`), so one compile covers both."""
    q_shape, v_shape = (1, 16, 8192, 192), (1, 16, 8192, 128)
    compiled = _compile(v5e, [q_shape, q_shape, v_shape], jnp.bfloat16, grad=True, causal=True)
    _check(compiled, jax.ShapeDtypeStruct(q_shape, jnp.bfloat16))


def test_default_layouts_need_no_copy(v5e: jax.Device) -> None:
    """With head_dim 128 and aligned lengths XLA's default layouts are already row-major."""
    shape = (1, 16, 4096, 128)
    _check(_compile(v5e, [shape] * 3, jnp.bfloat16, row_major=False, causal=True))


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradients"])
def test_segment_ids_need_no_copy(v5e: jax.Device, grad: bool) -> None:
    """Segment ids reach the kernels as ``[batch, 1, len]`` views of ``[batch, len]``."""
    sharding = SingleDeviceSharding(v5e)
    qkv = jax.ShapeDtypeStruct((2, 4, 1024, 128), jnp.bfloat16, sharding=sharding)
    ids = jax.ShapeDtypeStruct((2, 1024), jnp.int32, sharding=sharding)

    def attention(q, k, v, q_ids, kv_ids):
        return pf.attention(q, k, v, segment_ids=pf.SegmentIds(q_ids, kv_ids), backend="pallas")

    def gradients(q, k, v, q_ids, kv_ids, d_out):
        _, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, q_ids, kv_ids), q, k, v)
        return vjp(d_out)

    args = (qkv, qkv, qkv, ids, ids, qkv) if grad else (qkv, qkv, qkv, ids, ids)
    lowered = jax.jit(gradients if grad else attention).trace(*args)
    _check(lowered.lower(lowering_platforms=("tpu",)).compile(), qkv if grad else None)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradients"])
def test_sinks_and_their_gradient_need_no_copy(v5e: jax.Device, grad: bool) -> None:
    """Sinks reach the forward kernel as a lane row per head; their gradient is a reduction
    of the output, its cotangent and the log-sum-exp beside the backward kernel."""
    sharding = SingleDeviceSharding(v5e)
    qkv = jax.ShapeDtypeStruct((1, 8, 2048, 128), jnp.bfloat16, sharding=sharding)
    sinks = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)

    def attention(q, k, v, sinks):
        return pf.attention(q, k, v, causal=True, sinks=sinks, backend="pallas")

    def gradients(q, k, v, sinks, d_out):
        _, vjp = jax.vjp(attention, q, k, v, sinks)
        return vjp(d_out)

    args = (qkv, qkv, qkv, sinks, qkv) if grad else (qkv, qkv, qkv, sinks)
    lowered = jax.jit(gradients if grad else attention).trace(*args)
    _check(lowered.lower(lowering_platforms=("tpu",)).compile(), qkv if grad else None)


BIAS_CASES = {
    # name: (q/k/v shape, bias shape, bias dtype, causal, bias differentiated)
    "causal-bf16-dbias": ((2, 8, 2048, 128), (1, 8, 2048, 2048), jnp.bfloat16, True, True),
    "unmasked-f32-constant": ((1, 8, 8192, 128), (1, 1, 8192, 8192), jnp.float32, False, False),
    "causal-f32-dbias": ((1, 4, 2048, 128), (1, 4, 2048, 2048), jnp.float32, True, True),
}


@pytest.mark.parametrize("name", list(BIAS_CASES))
def test_bias_and_its_gradient_compile(v5e: jax.Device, name: str) -> None:
    """A bias reaches the forward kernel by blocks (its broadcast axes through the index map)
    and the backward kernel transposed once; its gradient, when it is differentiated, is the
    backward kernel's float32 ``[batch, heads, N, N]``, summed to the bias's shape. A constant
    bias costs no gradient. Default blocks (the forward's capped for the bias) fit VMEM."""
    from pallas_flash_pallas import BlockSizes, flash_attention

    shape, bias_shape, bias_dtype, causal, differentiated = BIAS_CASES[name]
    sharding = SingleDeviceSharding(v5e)
    qkv = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)
    bias = jax.ShapeDtypeStruct(bias_shape, bias_dtype, sharding=sharding)
    spec = pf.AttentionSpec(sm_scale=shape[-1] ** -0.5, causal=causal)

    def gradients(q, k, v, bias, d_out):
        def attention(q, k, v, bias):
            return flash_attention(q, k, v, None, None, bias, spec, BlockSizes())

        if differentiated:
            return jax.vjp(attention, q, k, v, bias)[1](d_out)
        return jax.vjp(lambda q, k, v: attention(q, k, v, bias), q, k, v)[1](d_out)

    lowered = jax.jit(gradients).trace(qkv, qkv, qkv, bias, qkv)
    compiled = lowered.lower(lowering_platforms=("tpu",)).compile()
    text = compiled.as_text()
    names = [call.name.split(".")[0] for call in hlo_ops.kernel_calls(text)]
    assert names == ["pallas_flash_forward", "pallas_flash_backward"]
    grads = compiled.output_shardings  # dq, dk, dv (and dbias)
    assert len(jax.tree.leaves(grads)) == 3 + differentiated
    bias_bytes = math.prod(bias_shape) * jnp.dtype(bias_dtype).itemsize
    scores = math.prod((*shape[:2], shape[2], shape[2]))  # [batch, heads, N, N]
    allowed = MAX_TEMP_BYTES + 2 * math.prod(shape) * 2 + 2 * 4 * math.prod(shape[:-1])
    allowed += bias_bytes  # the transposed bias the backward reads
    if differentiated:  # the kernel's float32 gradient (transposed back and summed, fused)
        allowed += 4 * scores
    assert compiled.memory_analysis().temp_size_in_bytes <= allowed


def test_480k_tokens_train_on_one_v5e_chip(v5e: jax.Device) -> None:
    """Forward and backward of 491,520 causal tokens (B=1, 16 heads of 128, bfloat16): the
    backward splits into a dk/dv pass and a dq pass, so HBM holds the arrays themselves (q, k,
    v, dout, the output, dq, dk, dv: 15 GiB) and the per-row statistics, within 16 GiB."""
    shape = (1, 16, 491_520, 128)
    compiled = _compile(v5e, [shape] * 3, jnp.bfloat16, grad=True, causal=True)
    kernels = [call.name.split(".")[0] for call in hlo_ops.kernel_calls(compiled.as_text())]
    assert kernels == [
        "pallas_flash_forward",
        "pallas_flash_backward_dkdv",
        "pallas_flash_backward_dq",
    ]
    memory = compiled.memory_analysis()
    total = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    array = math.prod(shape) * 2
    assert total <= 8 * array + (100 << 20) <= TARGETS["v5e-1"].hbm_bytes, memory


def test_context_parallel_training_over_a_slice() -> None:
    """Causal forward and backward of 2,048 zigzag tokens a chip over a v5e-4 slice (16 heads
    of 128, bfloat16): the K/V chunks go round the ring by collective permutes, each moving one
    device's chunk (K or V in bfloat16, dK or dV in float32), and each chip holds its share of
    the arrays with little beside them. (Larger slices compile in the bench's context rows,
    `pallas-flash bench --context`: v5e-16 took 2 minutes here.)"""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(target_devices(TARGETS["v5e-4"]), ("seq",))
    tokens = 2048 * mesh.size  # 4,096 a chip compiles the same ring in 3x the time
    split = NamedSharding(mesh, PartitionSpec(None, None, "seq", None))
    x = jax.ShapeDtypeStruct((1, 16, tokens, 128), jnp.bfloat16, sharding=split)

    def attention(q, k, v):
        return pf.attention(q, k, v, causal=True, mesh=mesh, context_layout="zigzag",
                            backend="pallas")  # fmt: skip

    def gradients(q, k, v, d_out):
        return jax.vjp(attention, q, k, v)[1](d_out)

    with jax.default_device(mesh.devices.flat[0]):
        lowered = jax.jit(gradients, out_shardings=split).trace(x, x, x, x)
        compiled = lowered.lower(lowering_platforms=("tpu",)).compile()
    text = compiled.as_text()
    kernels = {call.name.split(".")[0] for call in hlo_ops.kernel_calls(text)}
    assert kernels == {"pallas_flash_forward", "pallas_flash_backward"}
    share = 16 * tokens * 128 // mesh.size  # elements of one device's q (or K, V) chunk
    for op in hlo_ops.collectives(text):  # the result tuple holds the chunk sent and received
        assert op.opcode == "collective-permute-start"
        assert min(abs(op.bytes - 2 * share * size) for size in (2, 4)) <= 64, op
    memory = compiled.memory_analysis()
    used = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    assert used <= 40 * share * 2, memory


def test_long_gqa_gradients_fit_in_chunks(v5e: jax.Device) -> None:
    """The query gradient of 16 query heads x 8192 rows (128 MiB with its output block) does
    not fit in VMEM at once: the backward runs in chunks, and dk, dv are summed over them."""
    q_shape, kv_shape = (1, 16, 8192, 128), (1, 1, 8192, 128)
    compiled = _compile(v5e, [q_shape, kv_shape, kv_shape], jnp.bfloat16, grad=True, causal=True)
    text = compiled.as_text()
    kernels = hlo_ops.kernel_calls(text)
    assert [call.name.split(".")[0] for call in kernels] == [
        "pallas_flash_forward",
        "pallas_flash_backward",
    ]
    assert "f32[1,1,2,8192,128]" in kernels[1].shape  # dk, dv partials of 2 chunks
    assert not [op for op in hlo_ops.find_copy_trap(text) if op.relayout is not False]
    # The float32 partials of dk and dv and the forward's output.
    assert compiled.memory_analysis().temp_size_in_bytes <= 2 * 4 * 8192 * 128 * 4 + (40 << 20)


GENERATION_CASES = {
    # The default blocks at their longest (8192-row query blocks without a mask, at head_dim
    # 256 in float32: the most VMEM), and a causal GQA call with its gradients.
    "d256-f32": ((1, 2, 2, 8192, 8192, 256), jnp.float32, False, {}),
    "causal-gqa-gradients": ((1, 4, 2, 4096, 4096, 128), jnp.bfloat16, True, {"causal": True}),
}


GENERATION_PAIRS = [
    ("v4", "d256-f32"),
    ("v4", "causal-gqa-gradients"),
    ("v5p", "d256-f32"),
    ("v6e", "causal-gqa-gradients"),
]
"""Every generation at least once, each at the case that strains it: v4 (the least VMEM) at
both, v5p at the most VMEM per call, v6e (v5e's VMEM and blocks, whose d256 float32 forward
`test_the_vmem_estimate_is_enough` compiles) at the backward."""


@pytest.mark.parametrize(("generation", "case"), GENERATION_PAIRS)
def test_compiles_for_each_generation(
    monkeypatch: pytest.MonkeyPatch, generation: str, case: str
) -> None:
    """With ``PALLAS_FLASH_TPU`` naming the target, the default blocks and VMEM limits are
    sized for it: Mosaic compiles the kernels for that chip without a VMEM overflow."""
    monkeypatch.setenv(tpu.GENERATION_ENV_VAR, generation)
    (batch, q_heads, kv_heads, q_len, kv_len, head_dim), dtype, grad, kwargs = GENERATION_CASES[
        case
    ]
    q_shape, kv_shape = (batch, q_heads, q_len, head_dim), (batch, kv_heads, kv_len, head_dim)
    device = target_devices(TARGETS[generation])[0]  # the bench's target of that name
    assert tpu.for_device_kind(device.device_kind).name == generation
    compiled = _compile(device, [q_shape, kv_shape, kv_shape], dtype, grad=grad, **kwargs)
    _check(compiled, jax.ShapeDtypeStruct(q_shape, dtype) if grad else None)


ESTIMATE_CASES = {
    # name: (q and kv shape, dtype, gradients, BlockSizes kwargs, pf.attention kwargs)
    "4096x4096-in-16-sub-blocks": (
        (1, 2, 8192, 128),
        jnp.bfloat16,
        False,
        {"block_q": 4096, "block_kv": 4096, "block_q_compute": 256, "full_block_compute": 1024},
        {},
    ),
    # 8192 x 1024 blocks in 2048 x 1024 tiles, the last of each block cut: the widest the
    # defaults fold; in float32 blocks of one such tile (FLOAT32_BLOCK_Q).
    "defaults-d256-bf16": ((1, 2, 8192, 256), jnp.bfloat16, False, {}, {}),
    "defaults-d256-f32": ((1, 2, 8192, 256), jnp.float32, False, {}, {}),
    "defaults-causal-gradients": ((1, 2, 4096, 128), jnp.bfloat16, True, {}, {"causal": True}),
}


@pytest.mark.parametrize("name", list(ESTIMATE_CASES))
def test_the_vmem_estimate_is_enough(
    monkeypatch: pytest.MonkeyPatch, v5e: jax.Device, name: str
) -> None:
    """Compiled with a scoped-VMEM limit of exactly the estimate (no headroom, no minimum),
    Mosaic finds room: the estimate bounds what the kernels allocate, so a configuration too
    large for a core gets the estimate's named error before compiling, never Mosaic's
    ``CompileTimeScopedVmemOom``."""
    from pallas_flash import tpu
    from pallas_flash_pallas import BlockSizes, PallasBackend

    monkeypatch.setattr(tpu, "VMEM_HEADROOM", 1.0)
    monkeypatch.setattr(tpu, "MIN_VMEM_LIMIT_BYTES", 0)
    jax.clear_caches()  # kernels traced earlier carry their earlier limits
    shape, dtype, grad, sizes, kwargs = ESTIMATE_CASES[name]
    sizes = BlockSizes(**sizes)
    plugin = _Plugin(PallasBackend(sizes, name="pallas-estimate"))
    pf.register_plugin(plugin)
    try:
        compiled = _compile(v5e, [shape] * 3, dtype, grad=grad, backend="pallas-estimate", **kwargs)
    finally:
        pf.unregister_plugin(plugin)
        jax.clear_caches()
    _check(compiled, jax.ShapeDtypeStruct(shape, dtype) if grad else None)


class _Plugin:
    """Registers one backend instance."""

    def __init__(self, backend: pf.Backend) -> None:
        self.backend = backend

    @pf.hookimpl
    def pallas_flash_backends(self) -> list[pf.Backend]:
        return [self.backend]
