"""`attention_fn` runs Flax's multi-head attention on a backend, matching Flax's own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_llama.flax_attention import attention_fn

nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")

X = jax.random.normal(jax.random.key(0), (2, 16, 32))


@pytest.mark.parametrize("backend, causal", [("xla", True), ("xla", False), ("pallas", False)])
def test_nnx_multi_head_attention(backend: str, causal: bool) -> None:
    def layer(**kwargs):
        return nnx.MultiHeadAttention(
            num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0), **kwargs
        )

    mask = nnx.make_causal_mask(X[..., 0]) if causal else None
    want = layer()(X, mask=mask)
    got = layer(attention_fn=attention_fn(backend))(X, mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_linen_multi_head_dot_product_attention() -> None:
    ref = linen.MultiHeadDotProductAttention(num_heads=4)
    variables = ref.init(jax.random.key(1), X)
    ours = linen.MultiHeadDotProductAttention(num_heads=4, attention_fn=attention_fn("xla"))
    mask = linen.make_causal_mask(X[..., 0])
    np.testing.assert_allclose(
        ours.apply(variables, X, mask=mask),
        ref.apply(variables, X, mask=mask),
        rtol=1e-5,
        atol=1e-5,
    )


def test_unsupported_arguments_raise() -> None:
    fn = attention_fn("pallas")
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(pf.UnsupportedFeatureError, match="dropout_rate"):
        fn(q, q, q, dropout_rate=0.1, deterministic=False)


def test_a_mask_runs_on_pallas_as_on_xla() -> None:
    q = jax.random.normal(jax.random.key(2), (1, 8, 2, 16))
    mask = jnp.tril(jnp.ones((1, 2, 8, 8), bool))
    out = attention_fn("pallas")(q, q, q, mask=mask)
    np.testing.assert_allclose(out, attention_fn("xla")(q, q, q, mask=mask), rtol=2e-5, atol=2e-5)
