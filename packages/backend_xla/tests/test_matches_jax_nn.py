"""The xla backend against ``jax.nn.dot_product_attention(..., implementation="xla")``.

The cases follow jax's own ``tests/nn_test.py`` (testDotProductAttention and its mask
variants): float32 and bfloat16, group sizes 1, 2 and 4 (GQA / MQA), an additive bias, a boolean
mask, causal masking, query and key/value sequence lengths, local windows with and without
causal, ``T != S`` and unbatched ``[T, N, H]`` inputs; outputs and gradients must agree.

Every case is built so that each query row within its sequence length sees at least one key:
there pf returns zeros and jax the mean of the values (``test_row_without_keys_differs``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
"""Absolute and relative tolerance of pf against jax (float32 differences are ~1e-7)."""

FAST_JIT = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
"""XLA:CPU compiles these tiny programs about twice as fast without LLVM optimisation."""


def _normal(seed: int, shape: tuple[int, ...], dtype: str) -> jax.Array:
    values = np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(values, dtype=DTYPES[dtype])


def _assert_close(actual: jax.Array, expected: jax.Array, dtype: str, *, name: str) -> None:
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert np.isfinite(actual).all(), f"{name}: has inf or NaN"
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(actual, expected, atol=tol, rtol=tol, err_msg=name)


def _assert_gradient_close(actual: jax.Array, expected: jax.Array, dtype: str, *, name: str):
    """Gradients sum over a sequence, so the tolerance scales with their magnitude (>= 1)."""
    expected32 = np.asarray(jnp.asarray(expected, jnp.float32))
    scale = max(1.0, float(np.abs(expected32).max()))
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    assert actual.shape == expected32.shape, f"{name}: shape {actual.shape} != {expected32.shape}"
    assert np.isfinite(actual).all(), f"{name}: has inf or NaN"
    tol = TOLERANCE[dtype] * scale
    np.testing.assert_allclose(actual, expected32, atol=tol, rtol=TOLERANCE[dtype], err_msg=name)


@dataclasses.dataclass(frozen=True)
class Case:
    """One ``dot_product_attention`` call in the ``[batch, seq, heads, head_dim]`` layout."""

    batch: int = 2
    q_len: int = 16
    kv_len: int = 16
    q_heads: int = 4
    kv_heads: int = 4
    head_dim: int = 8
    bias: tuple[int, ...] | None = None  # shape broadcastable to [B, N, T, S]
    mask: tuple[int, ...] | None = None  # shape broadcastable to [B, N, T, S]
    is_causal: bool = False
    q_lens: tuple[int, ...] | None = None
    kv_lens: tuple[int, ...] | None = None
    window: int | tuple[int, int] | None = None
    scale: float | None = None
    unbatched: bool = False  # batch must be 1; q/k/v (and bias/mask) lose the batch axis


CASES = {
    "mha": Case(),
    "gqa2-scale-bias-mask-per-head": Case(
        kv_heads=2, scale=0.7, bias=(2, 4, 16, 16), mask=(1, 4, 16, 16)
    ),
    "mqa-causal": Case(kv_heads=1, is_causal=True),
    "gqa2-bias-broadcast-mask-one-head": Case(kv_heads=2, bias=(1, 4, 1, 16), mask=(2, 1, 16, 16)),
    "mqa-bias-one-head-mask-per-head": Case(kv_heads=1, bias=(2, 1, 16, 16), mask=(1, 4, 16, 16)),
    "gqa2-causal-window-padding": Case(
        kv_heads=2, is_causal=True, window=(4, 2), q_lens=(12, 9), kv_lens=(16, 7)
    ),
    "mha-window-int-q-padding": Case(window=3, q_lens=(5, 16)),
    "gqa2-window-pair-kv-padding": Case(kv_heads=2, window=(4, 1), kv_lens=(16, 13)),
    "t-less-than-s-causal": Case(q_len=8, kv_len=24, kv_heads=2, is_causal=True),
    "t-greater-than-s-causal": Case(q_len=24, kv_len=8, kv_heads=1, is_causal=True),
    "t-ne-s-window-padding": Case(
        q_len=12, kv_len=20, kv_heads=2, window=(2, 3), q_lens=(12, 7), kv_lens=(20, 10)
    ),
    "unbatched-causal-bias-mask": Case(
        batch=1, kv_heads=2, is_causal=True, bias=(4, 16, 16), mask=(1, 16, 16), unbatched=True
    ),
    "unbatched-window-causal": Case(
        batch=1, kv_heads=4, window=(3, 2), is_causal=True, unbatched=True
    ),
    "everything": Case(
        q_len=16,
        kv_len=20,
        kv_heads=2,
        bias=(2, 4, 16, 20),
        mask=(2, 4, 16, 20),
        is_causal=True,
        q_lens=(16, 13),
        kv_lens=(20, 14),
        window=(6, 0),
        scale=0.4,
    ),
}
BFLOAT16_CASES = ("mqa-causal", "gqa2-causal-window-padding")
GRADIENT_CASES = [
    ("everything", "float32"),
    ("everything", "bfloat16"),
    ("mqa-bias-one-head-mask-per-head", "float32"),
    ("mha-window-int-q-padding", "float32"),
    ("t-greater-than-s-causal", "float32"),
    ("unbatched-causal-bias-mask", "float32"),
]
"""Gradients compile slowly: these cases together cover bias, mask, causal, windows, both
sequence lengths, GQA/MQA, T != S, unbatched inputs and bfloat16."""


def _visible(case: Case, mask: np.ndarray | None) -> np.ndarray:
    """``[B, N, T, S]``: which keys each query sees, by jax's rules (top-left alignment)."""
    shape = (case.batch, case.q_heads, case.q_len, case.kv_len)
    i = np.arange(case.q_len)[:, None]
    j = np.arange(case.kv_len)[None, :]
    visible = np.ones(shape, dtype=bool)
    if mask is not None:
        visible &= np.broadcast_to(mask.reshape((-1, *mask.shape[-3:])), shape)
    if case.is_causal:
        visible &= j <= i
    if case.window is not None:
        left, right = (case.window, case.window) if isinstance(case.window, int) else case.window
        visible &= (j >= i - left) & (j <= i + right)
    if case.kv_lens is not None:
        visible &= j[None, None] < np.asarray(case.kv_lens)[:, None, None, None]
    return visible


def _make(case: Case, dtype: str, seed: int = 0) -> tuple[tuple, dict]:
    """Positional ``(query, key, value, bias, mask)`` and the keyword arguments of one call."""
    b, t, s = case.batch, case.q_len, case.kv_len
    n, k, h = case.q_heads, case.kv_heads, case.head_dim
    query = _normal(seed, (b, t, n, h), dtype)
    key = _normal(seed + 1, (b, s, k, h), dtype)
    value = _normal(seed + 2, (b, s, k, h), dtype)
    bias = None if case.bias is None else _normal(seed + 3, case.bias, dtype)
    mask = None
    if case.mask is not None:
        rng = np.random.default_rng(seed + 4)
        mask = rng.random(case.mask) < 0.6
        # The diagonal stays visible, so every valid query row keeps at least one key.
        rows, cols = np.arange(case.mask[-2]), np.minimum(np.arange(case.mask[-2]), s - 1)
        mask[..., rows, cols] = True
    q_lens = case.q_lens or (t,) * b
    visible = _visible(case, mask)
    for batch_index, q_len in enumerate(q_lens):
        assert visible[batch_index, :, :q_len].any(-1).all(), "bad case: a valid row sees no key"
    if case.unbatched:
        assert b == 1
        query, key, value = query[0], key[0], value[0]
    kwargs = {
        "scale": case.scale,
        "is_causal": case.is_causal,
        "local_window_size": case.window,
        "query_seq_lengths": None if case.q_lens is None else jnp.asarray(case.q_lens, jnp.int32),
        "key_value_seq_lengths": (
            None if case.kv_lens is None else jnp.asarray(case.kv_lens, jnp.int32)
        ),
    }
    return (query, key, value, bias, None if mask is None else jnp.asarray(mask)), kwargs


def _jax_nn(query, key, value, bias, mask, **kwargs):
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, implementation="xla", **kwargs
    )


def _pf(query, key, value, bias, mask, **kwargs):
    return pf.dot_product_attention(query, key, value, bias, mask, implementation="xla", **kwargs)


def _outputs_and_gradients(functions, primals: tuple, cotangent: jax.Array | None) -> list:
    """``[(output, gradients of the primals for cotangent)]`` of each function, in one program.

    One compilation serves jax and pf: compiling dominates the run time of these small cases,
    and a program with gradients compiles about three times slower, so ``cotangent=None``
    skips them (the gradients are then ``None``).
    """

    @FAST_JIT
    def run(primals, cotangent):
        results = []
        for fn in functions:
            if cotangent is None:
                results.append((fn(*primals), None))
            else:
                out, pullback = jax.vjp(fn, *primals)
                results.append((out, pullback(cotangent)))
        return results

    return run(primals, cotangent)


def _compare_case(name: str, dtype: str, *, gradients: bool) -> None:
    args, kwargs = _make(CASES[name], dtype)
    query, key, value, bias, mask = args
    primals = (query, key, value) if bias is None else (query, key, value, bias)

    def with_mask(fn):
        return lambda *p: fn(*p[:3], p[3] if len(p) > 3 else None, mask, **kwargs)

    cotangent = _normal(7, query.shape, dtype) if gradients else None
    (expected, expected_grads), (actual, actual_grads) = _outputs_and_gradients(
        (with_mask(_jax_nn), with_mask(_pf)), primals, cotangent
    )
    assert actual.shape == query.shape
    assert actual.dtype == query.dtype
    _assert_close(actual, expected, dtype, name=f"{name} output")
    if not gradients:
        return
    grad_names = ("d_query", "d_key", "d_value", "d_bias")
    assert len(actual_grads) == len(primals)
    for grad_name, primal, got, wanted in zip(
        grad_names, primals, actual_grads, expected_grads, strict=False
    ):
        assert got.dtype == primal.dtype, f"{grad_name}: dtype {got.dtype} != {primal.dtype}"
        assert np.abs(np.asarray(wanted, np.float32)).max() > 0.0, f"{grad_name} is all zeros"
        _assert_gradient_close(got, wanted, dtype, name=f"{name} {grad_name}")


@pytest.mark.parametrize("name", list(CASES))
def test_float32_matches_jax(name: str) -> None:
    _compare_case(name, "float32", gradients=False)


@pytest.mark.parametrize("name", BFLOAT16_CASES)
def test_bfloat16_matches_jax(name: str) -> None:
    _compare_case(name, "bfloat16", gradients=False)


@pytest.mark.parametrize(("name", "dtype"), GRADIENT_CASES)
def test_gradients_match_jax(name: str, dtype: str) -> None:
    _compare_case(name, dtype, gradients=True)


def test_row_without_keys_differs() -> None:
    """Documented difference: a query row that sees no key is zero in pf, the mean of v in jax."""
    query = _normal(0, (2, 16, 4, 8), "float32")
    key = _normal(1, (2, 16, 2, 8), "float32")
    value = _normal(2, (2, 16, 2, 8), "float32")
    mask = np.ones((2, 1, 16, 16), dtype=bool)
    mask[0, :, 5, :] = False  # batch 0, query row 5 sees nothing; batch 1 sees no key at all
    kv_lengths = jnp.asarray([16, 0], jnp.int32)

    @FAST_JIT
    def both(query, key, value):
        return [
            fn(query, key, value, None, jnp.asarray(mask), key_value_seq_lengths=kv_lengths)
            for fn in (_jax_nn, _pf)
        ]

    expected, actual = both(query, key, value)
    np.testing.assert_array_equal(actual[0, 5], 0.0)
    np.testing.assert_array_equal(actual[1], 0.0)
    # jax spreads the probability evenly over every key: the mean of the values of the kv head.
    mean_v = np.repeat(np.asarray(value).mean(axis=1), 2, axis=1)  # [batch, q_heads, head_dim]
    np.testing.assert_allclose(expected[0, 5], mean_v[0], atol=1e-5)
    np.testing.assert_allclose(expected[1], np.broadcast_to(mean_v[1], (16, 4, 8)), atol=1e-5)
    assert np.abs(np.asarray(expected[1])).max() > 0.05
    # Rows that see a key still agree.
    keep = np.arange(16) != 5
    _assert_close(actual[0, keep], expected[0, keep], "float32", name="rows with keys")


# --- pf.attention: [batch, heads, seq, head_dim], causal aligned to the end of the keys. ---


def _jax_heads_major(q, k, v, **kwargs) -> jax.Array:
    """jax.nn.dot_product_attention on ``[batch, heads, seq, head_dim]`` arrays."""
    out = jax.nn.dot_product_attention(
        *(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), implementation="xla", **kwargs
    )
    return jnp.swapaxes(out, 1, 2)


def _qkv(b, n, k, t, s, h, dtype, seed=0):
    return (
        _normal(seed, (b, n, t, h), dtype),
        _normal(seed + 1, (b, k, s, h), dtype),
        _normal(seed + 2, (b, k, s, h), dtype),
    )


def _bottom_right_mask(q_len: int, kv_len: int, window: tuple[int, int] | None = None):
    """``[1, 1, q_len, kv_len]``: query ``i`` sees keys ``j <= i + kv_len - q_len``."""
    pos = np.arange(q_len)[:, None] + kv_len - q_len
    j = np.arange(kv_len)[None, :]
    visible = j <= pos
    if window is not None:
        visible = (j >= pos - window[0]) & (j <= pos + window[1])
    return jnp.asarray(visible[None, None])


def _compare_attention(
    q, k, v, jax_kwargs: dict, pf_kwargs: dict, dtype: str, *, gradients: bool
) -> jax.Array:
    """Compares outputs (and gradients); returns pf's output."""
    cotangent = _normal(9, q.shape, dtype) if gradients else None
    (expected, expected_grads), (actual, actual_grads) = _outputs_and_gradients(
        (
            lambda q, k, v: _jax_heads_major(q, k, v, **jax_kwargs),
            lambda q, k, v: pf.attention(q, k, v, backend="xla", **pf_kwargs),
        ),
        (q, k, v),
        cotangent,
    )
    assert actual.dtype == q.dtype
    _assert_close(actual, expected, dtype, name="output")
    if gradients:
        for grad_name, got, wanted in zip(
            ("dq", "dk", "dv"), actual_grads, expected_grads, strict=True
        ):
            _assert_gradient_close(got, wanted, dtype, name=grad_name)
    return actual


@pytest.mark.parametrize(
    ("kv_heads", "causal", "dtype", "gradients"),
    [(2, True, "float32", True), (4, False, "float32", False), (1, True, "bfloat16", False)],
)
def test_attention_equal_lengths_matches_jax(
    kv_heads: int, causal: bool, dtype: str, gradients: bool
) -> None:
    q, k, v = _qkv(2, 4, kv_heads, 16, 16, 8, dtype)
    jax_kwargs, pf_kwargs = {"is_causal": causal}, {"causal": causal}
    _compare_attention(q, k, v, jax_kwargs, pf_kwargs, dtype, gradients=gradients)


@pytest.mark.parametrize(
    ("q_len", "kv_len", "kv_heads", "gradients"), [(8, 24, 2, True), (1, 16, 1, False)]
)
def test_attention_causal_short_queries_is_bottom_right(
    q_len: int, kv_len: int, kv_heads: int, gradients: bool
) -> None:
    q, k, v = _qkv(2, 4, kv_heads, q_len, kv_len, 8, "float32")
    mask = _bottom_right_mask(q_len, kv_len)
    actual = _compare_attention(
        q, k, v, {"mask": mask}, {"causal": True}, "float32", gradients=gradients
    )
    # Top-left alignment (jax's is_causal) would give query 0 the value of key 0 alone.
    first_value = np.repeat(np.asarray(v[:, :, 0]), 4 // kv_heads, axis=1)  # [batch, heads, d]
    assert np.abs(np.asarray(actual[:, :, 0]) - first_value).max() > 0.1


def test_attention_window_short_queries_is_bottom_right() -> None:
    q, k, v = _qkv(2, 4, 2, 8, 24, 8, "float32")
    mask = _bottom_right_mask(8, 24, window=(5, 2))
    pf_kwargs = {"sliding_window": (5, 2)}
    _compare_attention(q, k, v, {"mask": mask}, pf_kwargs, "float32", gradients=False)
