"""The dense XLA backend itself: what it compiles to, decode, registration, masked gradients."""

from __future__ import annotations

import functools
import importlib.metadata
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_xla import XlaBackend, dense, plugin

FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""XLA:CPU compiles these tiny programs about twice as fast without LLVM optimisation."""
FAST_JIT = functools.partial(jax.jit, compiler_options=FAST_COMPILE)


def _normal(seed: int, shape: tuple[int, ...], dtype=jnp.float32, scale: float = 1.0):
    values = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(values, dtype=dtype)


# --- Reading the lowered StableHLO of @main. ---

_TENSOR = re.compile(r"tensor<([^>]*)>")
_OP = re.compile(r"^\s*(%[\w#]+)(?::\d+)? = ([\w.]+)(.*)$")


def _tensor_type(text: str) -> tuple[tuple[int, ...], str]:
    """``"1x2x64x32xf32"`` to ``((1, 2, 64, 32), "f32")``."""
    *dims, dtype = text.split("x")
    return tuple(int(d) for d in dims), dtype


def _main_ops(module: str) -> tuple[dict[str, tuple], list[tuple]]:
    """The arguments of ``@main`` (name to type) and its ops.

    Each op is ``(result, op_name, operands, result_type, line)``, ``result_type`` being the
    type of the first result, e.g. ``((1, 2, 64, 32), "f32")``.
    """
    lines = module.splitlines()
    start = next(i for i, line in enumerate(lines) if "func.func public @main" in line)
    header = lines[start]
    args = {
        name: _tensor_type(text)
        for name, text in re.findall(r"(%arg\d+): tensor<([^>]*)>", header.split(") ->")[0])
    }
    ops = []
    for line in lines[start + 1 :]:
        if line.startswith("  }"):
            break
        match = _OP.match(line)
        if match is None:
            continue
        result, op_name, rest = match.groups()
        types = _TENSOR.findall(rest)
        operands = re.findall(r"%[\w#]+", rest.split(" : ")[0])
        ops.append((result, op_name, operands, _tensor_type(types[-1]), line))
    assert ops, "no ops parsed from @main"
    return args, ops


def _kv_copies(module: str, kv_args: tuple[str, ...]) -> tuple[list[tuple], list[tuple]]:
    """Values computed from K/V by anything other than a contraction, and the contractions.

    Returns ``(derived, dots)``: ``derived`` holds ``(result_type, line)`` of every value that
    data-movement ops (broadcast, reshape, concatenate, gather, ...) or elementwise ops make from
    the K/V arguments; ``dots`` holds ``(operand types, line)`` of each ``dot_general`` that reads
    such a value.
    """
    _, ops = _main_ops(module)
    from_kv = set(kv_args)
    derived, dots = [], []
    for result, op_name, operands, result_type, line in ops:
        if not from_kv.intersection(operands):
            continue
        if op_name in ("stablehlo.dot_general", "stablehlo.dot"):
            dots.append(([_tensor_type(t) for t in _TENSOR.findall(line.split(" : ")[-1])], line))
            continue
        from_kv.add(result)
        derived.append((result_type, line))
    return derived, dots


def _assert_no_repeated_kv(module: str, k_shape: tuple[int, ...], q_heads: int) -> None:
    """No K/V-derived value is larger than K/V itself, and the contractions read K/V as is."""
    batch, kv_heads, kv_len, head_dim = k_shape
    group = q_heads // kv_heads
    repeated = {(batch, q_heads, kv_len, head_dim), (batch, kv_heads, group, kv_len, head_dim)}
    derived, dots = _kv_copies(module, ("%arg1", "%arg2"))
    for (shape, _), line in derived:
        assert shape not in repeated, f"K/V repeated to the query heads:\n{line}"
        assert math.prod(shape) <= math.prod(k_shape), f"K/V copy larger than K/V:\n{line}"
    assert len(dots) == 2, f"expected q.k and p.v contractions, got {[d[1] for d in dots]}"
    for operand_types, line in dots:
        assert (k_shape, "f32") in operand_types, f"contraction does not read K/V as is:\n{line}"


def test_gqa_does_not_repeat_kv_in_lowered_hlo() -> None:
    q = jnp.zeros((1, 8, 64, 32), jnp.float32)
    k = jnp.zeros((1, 2, 64, 32), jnp.float32)
    spec = pf.AttentionSpec(sm_scale=32**-0.5, causal=True)
    module = dense.attention.lower(q, k, k, spec, None, None, None).as_text()
    assert "%arg1: tensor<1x2x64x32xf32>" in module
    assert "%arg2: tensor<1x2x64x32xf32>" in module
    _assert_no_repeated_kv(module, (1, 2, 64, 32), q_heads=8)


def test_repeat_detector_flags_jnp_repeat() -> None:
    """The check above fails for attention that repeats K/V with ``jnp.repeat``."""

    def repeating_attention(q, k, v):
        k, v = jnp.repeat(k, 4, axis=1), jnp.repeat(v, 4, axis=1)
        scores = jnp.einsum("bhtd,bhsd->bhts", q, k)
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(scores), v)

    q, k = jnp.zeros((1, 8, 64, 32)), jnp.zeros((1, 2, 64, 32))
    module = jax.jit(repeating_attention).lower(q, k, k).as_text()
    derived, _ = _kv_copies(module, ("%arg1", "%arg2"))
    assert ((1, 8, 64, 32), "f32") in [t for t, _ in derived]
    with pytest.raises(AssertionError, match="repeated to the query heads"):
        _assert_no_repeated_kv(module, (1, 2, 64, 32), q_heads=8)


_HLO_ARRAY = re.compile(r"\b(?:f32|bf16|f16|pred|s32)\[([\d,]*)\]")


def test_gqa_does_not_repeat_kv_in_compiled_hlo() -> None:
    """With q_len != kv_len, no array anywhere may have the size of K repeated to 8 heads."""
    q = jnp.zeros((1, 8, 16, 32), jnp.float32)
    k = jnp.zeros((1, 2, 64, 32), jnp.float32)
    repeated_size = 1 * 8 * 64 * 32
    spec = pf.AttentionSpec(sm_scale=32**-0.5)
    lowered = dense.attention.lower(q, k, k, spec, None, None, None)
    compiled = lowered.compile(FAST_COMPILE).as_text()
    assert "f32[1,2,64,32]" in compiled
    sizes = {
        dims: math.prod(int(d) for d in dims.split(",") if d)
        for dims in _HLO_ARRAY.findall(compiled)
    }
    assert sizes, "no array shapes parsed from the compiled HLO"
    too_big = [dims for dims, size in sizes.items() if size >= repeated_size]
    assert not too_big, f"arrays as large as K repeated to the query heads: {too_big}"
    lowered_shapes = [_tensor_type(t)[0] for t in _TENSOR.findall(lowered.as_text())]
    assert all(math.prod(s) < repeated_size for s in lowered_shapes)


def test_softmax_runs_in_float32_for_bfloat16() -> None:
    q = jnp.zeros((1, 4, 16, 8), jnp.bfloat16)
    k = jnp.zeros((1, 2, 16, 8), jnp.bfloat16)
    spec = pf.AttentionSpec(sm_scale=0.25, causal=True)
    module = dense.attention.lower(q, k, k, spec, None, None, None).as_text()
    args, ops = _main_ops(module)
    assert args["%arg0"] == ((1, 4, 16, 8), "bf16")
    scores_shape = (1, 2, 2, 16, 16)  # [batch, kv_heads, group, q_len, kv_len]

    exps = [op for op in ops if op[1] == "stablehlo.exponential"]
    assert exps, "no exponential in the lowered module"
    assert all(op[3] == (scores_shape, "f32") for op in exps), [op[4] for op in exps]
    reductions = [op for op in ops if op[1] == "stablehlo.reduce"]
    assert {re.search(r"applies (\S+)", op[4]).group(1) for op in reductions} >= {
        "stablehlo.maximum",
        "stablehlo.add",
    }
    for op in reductions:
        operand = _tensor_type(_TENSOR.findall(op[4].split(" : ")[-1])[0])
        assert operand == (scores_shape, "f32"), op[4]
    qk = next(op for op in ops if op[1] == "stablehlo.dot_general")
    assert qk[3] == (scores_shape, "f32"), qk[4]
    assert re.search(r"-> \(tensor<1x4x16x8xbf16>", module), "output is not bfloat16"


def test_output_dtype_follows_input() -> None:
    q = _normal(0, (1, 4, 16, 8), jnp.bfloat16)
    k = _normal(1, (1, 2, 16, 8), jnp.bfloat16)
    v = _normal(2, (1, 2, 16, 8), jnp.bfloat16)

    @FAST_JIT
    def both(q, k, v):
        as_f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return [
            pf.attention(*x, backend="xla", causal=True, sm_scale=0.25) for x in ((q, k, v), as_f32)
        ]

    out, expected = both(q, k, v)
    assert out.dtype == jnp.bfloat16
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=2e-2, rtol=2e-2)


# --- Decode. ---

BATCH, Q_HEADS, KV_HEADS, MAX_LEN, HEAD_DIM = 4, 8, 2, 32, 16
LENGTHS = (32, 17, 0, 1)


def _decode_inputs(dtype=jnp.float32):
    q = _normal(0, (BATCH, Q_HEADS, HEAD_DIM), dtype)
    k_cache = np.array(_normal(1, (BATCH, KV_HEADS, MAX_LEN, HEAD_DIM)))
    v_cache = np.array(_normal(2, (BATCH, KV_HEADS, MAX_LEN, HEAD_DIM)))
    for b, length in enumerate(LENGTHS):  # loud garbage past each length must be ignored
        k_cache[b, :, length:] = 50.0
        v_cache[b, :, length:] = 1e4
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    return q, jnp.asarray(k_cache, dtype), jnp.asarray(v_cache, dtype), lengths


def test_decode_equals_attention_on_truncated_cache() -> None:
    q, k_cache, v_cache, lengths = _decode_inputs()

    @FAST_JIT
    def run(q, k_cache, v_cache, lengths):
        truncated = {
            b: pf.attention(
                q[b : b + 1, :, None],
                k_cache[b : b + 1, :, :length],
                v_cache[b : b + 1, :, :length],
                backend="xla",
            )[0, :, 0]
            for b, length in enumerate(LENGTHS)
            if length > 0
        }
        return pf.decode(q, k_cache, v_cache, lengths, backend="xla"), truncated

    out, truncated = run(q, k_cache, v_cache, lengths)
    assert out.shape == q.shape
    assert out.dtype == q.dtype
    for b, length in enumerate(LENGTHS):
        if length == 0:
            np.testing.assert_array_equal(out[b], 0.0)
        else:
            np.testing.assert_allclose(out[b], truncated[b], atol=1e-5, rtol=1e-5, err_msg=f"{b}")
    assert np.abs(np.asarray(out)).max() < 10.0  # no garbage value leaked in


def test_decode_equals_dot_product_attention_with_lengths() -> None:
    @FAST_JIT
    def run(q, k_cache, v_cache, lengths):
        expected = pf.dot_product_attention(
            q[:, None],
            jnp.swapaxes(k_cache, 1, 2),
            jnp.swapaxes(v_cache, 1, 2),
            key_value_seq_lengths=lengths,
            implementation="xla",
        )[:, 0]
        return pf.decode(q, k_cache, v_cache, lengths, backend="xla"), expected

    out, expected = run(*_decode_inputs())
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(expected[2], 0.0)


def test_decode_softcap_and_scale_equal_attention_with_segments() -> None:
    q, k_cache, v_cache, lengths = _decode_inputs()
    q = q * 4.0  # large logits, so the cap matters

    @FAST_JIT
    def run(q, k_cache, v_cache, lengths):
        in_cache = jnp.arange(MAX_LEN)[None, :] < lengths[:, None]
        segments = pf.SegmentIds(
            q=jnp.zeros((BATCH, 1), jnp.int32), kv=jnp.where(in_cache, 0, 1).astype(jnp.int32)
        )
        expected = pf.attention(
            q[:, :, None],
            k_cache,
            v_cache,
            sm_scale=0.3,
            softcap=2.0,
            segment_ids=segments,
            backend="xla",
        )[:, :, 0]
        capped = pf.decode(q, k_cache, v_cache, lengths, sm_scale=0.3, softcap=2.0, backend="xla")
        uncapped = pf.decode(q, k_cache, v_cache, lengths, sm_scale=0.3, backend="xla")
        return capped, expected, uncapped

    out, expected, uncapped = run(q, k_cache, v_cache, lengths)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(out - uncapped)).max() > 1e-2


def test_decode_under_jit_bfloat16_and_mesh() -> None:
    q, k_cache, v_cache, lengths = _decode_inputs()
    eager = pf.decode(q, k_cache, v_cache, lengths, backend="xla")
    traced = FAST_JIT(lambda *a: pf.decode(*a, backend="xla"))(q, k_cache, v_cache, lengths)
    np.testing.assert_allclose(traced, eager, atol=1e-6, rtol=1e-6)
    # The backend does not declare multi_device: a mesh is accepted and ignored.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
    with_mesh = pf.decode(q, k_cache, v_cache, lengths, backend="xla", mesh=mesh)
    np.testing.assert_array_equal(with_mesh, eager)
    q16, k16, v16, _ = _decode_inputs(jnp.bfloat16)

    @FAST_JIT
    def bf16_and_f32(q16, k16, v16, lengths):
        upcast = (x.astype(jnp.float32) for x in (q16, k16, v16))
        return [pf.decode(*x, lengths, backend="xla") for x in ((q16, k16, v16), upcast)]

    out16, reference = bf16_and_f32(q16, k16, v16, lengths)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out16, np.float32), reference, atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(np.asarray(out16[2], np.float32), 0.0)


# --- Registration. ---


def test_backend_declares_every_capability_but_the_multi_device_ones() -> None:
    multi_device = {pf.Capability.MULTI_DEVICE, pf.Capability.CONTEXT_PARALLEL}
    assert frozenset(XlaBackend.capabilities) == frozenset(pf.Capability) - multi_device
    assert frozenset(XlaBackend.platforms) == {"cpu", "gpu", "tpu"}
    assert XlaBackend.name == "xla"
    backends = plugin.pallas_flash_backends()
    assert [type(b) for b in backends] == [XlaBackend]


def test_list_backends_reports_xla_from_its_entry_point() -> None:
    (entry_point,) = importlib.metadata.entry_points(group="pallas_flash.backends", name="xla")
    assert entry_point.value == "pallas_flash_xla.plugin"
    assert entry_point.dist is not None
    assert entry_point.dist.name == "pallas-flash-xla"

    infos = {info.name: info for info in pf.list_backends()}
    assert "xla" in infos, infos
    info = infos["xla"]
    assert info.distribution == "pallas-flash-xla"
    assert info.capabilities == frozenset(XlaBackend.capabilities)
    assert info.platforms == frozenset({"cpu", "gpu", "tpu"})
    assert info.priority == 0
    assert isinstance(pf.get_backend("xla"), XlaBackend)


# --- Gradients where a query sees no key. ---


def test_gradients_finite_for_fully_masked_causal_rows() -> None:
    """causal with q_len 12 > kv_len 8: query rows 0..3 sit before the first key."""
    q = _normal(0, (2, 4, 12, 8))
    k = _normal(1, (2, 2, 8, 8))
    v = _normal(2, (2, 2, 8, 8))

    @FAST_JIT
    def grads(q, k, v):
        def loss(q, k, v):
            return pf.attention(q, k, v, causal=True, backend="xla").sum()

        out = pf.attention(q, k, v, causal=True, backend="xla")

        # Rows 4.. see keys j <= i - 4, exactly as all rows of a square causal call.
        def seen_loss(q, k, v):
            return pf.attention(q[:, :, 4:], k, v, causal=True, backend="xla").sum()

        return out, jax.grad(loss, (0, 1, 2))(q, k, v), jax.grad(seen_loss, (0, 1, 2))(q, k, v)

    out, (dq, dk, dv), (dq_seen, dk_seen, dv_seen) = grads(q, k, v)
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.isfinite(np.asarray(grad)).all(), f"{name} has inf or NaN"
    np.testing.assert_array_equal(out[:, :, :4], 0.0)
    np.testing.assert_array_equal(dq[:, :, :4], 0.0)
    assert np.abs(np.asarray(dq[:, :, 4:])).max() > 1e-3
    np.testing.assert_allclose(dq[:, :, 4:], dq_seen[:, :, 4:], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(dk, dk_seen, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(dv, dv_seen, atol=1e-5, rtol=1e-5)


def test_gradients_finite_for_rows_masked_by_mask_bias_and_lengths() -> None:
    query = _normal(0, (2, 16, 4, 8))
    key = _normal(1, (2, 16, 2, 8))
    value = _normal(2, (2, 16, 2, 8))
    mask = np.ones((2, 1, 16, 16), dtype=bool)
    mask[0, :, 3] = False  # batch 0, query 3: masked out entirely
    bias = np.array(_normal(3, (2, 4, 16, 16)))
    bias[0, :, 7] = -np.inf  # batch 0, query 7: an additive mask of -inf
    kv_lengths = jnp.asarray([16, 0], jnp.int32)  # batch 1 sees no key at all

    def call(query, key, value):
        return pf.dot_product_attention(
            query,
            key,
            value,
            jnp.asarray(bias),
            jnp.asarray(mask),
            key_value_seq_lengths=kv_lengths,
            implementation="xla",
        )

    out, (d_query, d_key, d_value) = FAST_JIT(
        lambda *a: (call(*a), jax.grad(lambda *b: call(*b).sum(), (0, 1, 2))(*a))
    )(query, key, value)
    for name, grad in (("d_query", d_query), ("d_key", d_key), ("d_value", d_value)):
        assert np.isfinite(np.asarray(grad)).all(), f"{name} has inf or NaN"
    for b, t in ((0, 3), (0, 7)):
        np.testing.assert_array_equal(out[b, t], 0.0)
        np.testing.assert_array_equal(d_query[b, t], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(d_query[1], 0.0)
    np.testing.assert_array_equal(d_key[1], 0.0)
    np.testing.assert_array_equal(d_value[1], 0.0)
    assert np.abs(np.asarray(d_query[0])).max() > 1e-3
