"""An ``attention_fn`` that runs Flax's multi-head attention on a Pallas-Flash backend.

``flax.nnx.MultiHeadAttention`` and ``flax.linen.MultiHeadDotProductAttention`` take an
``attention_fn`` with the signature of Flax's ``dot_product_attention``: query, key, value
``[batch..., seq, heads, head_dim]``, an optional additive ``bias`` and a ``mask`` (True or
nonzero: attend; Flax's mask helpers make float masks), both broadcastable to
``[batch..., heads, q_len, kv_len]``. `attention_fn` returns one that calls
``pf.dot_product_attention`` on the backend named. Flax is not imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import pallas_flash as pf


def attention_fn(backend: str | None = None) -> Callable[..., jax.Array]:
    """A Flax ``attention_fn`` computing on ``backend`` (default: the registry's choice).

    The scale is Flax's (``1 / sqrt(head_dim)``). Dropout is not supported: a call with
    ``dropout_rate > 0`` that is not ``deterministic`` raises, as does a ``bias`` or ``mask``
    on a backend without those capabilities (``xla`` and ``pallas`` have both; for packed
    sequences segment ids through `pallas_flash.attention` skip the hidden blocks).
    """

    def attend(
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        broadcast_dropout: bool = True,
        dropout_rng: jax.Array | None = None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: Any = None,
        precision: Any = None,
        module: Any = None,
        **unused: Any,
    ) -> jax.Array:
        if dropout_rate > 0 and not deterministic:
            raise pf.UnsupportedFeatureError(
                f"dropout_rate: Pallas-Flash attention has no dropout, got {dropout_rate} "
                "with deterministic=False"
            )
        if dtype is not None:
            query, key, value = (x.astype(dtype) for x in (query, key, value))
        batch_dims = query.shape[:-3]
        flat = [x.reshape((-1, *x.shape[-3:])) for x in (query, key, value)]

        def flatten_batch(x: jax.Array | None) -> jax.Array | None:
            if x is None or x.ndim <= 3:
                return x
            x = jnp.broadcast_to(x, (*batch_dims, *x.shape[-3:]))
            return x.reshape((-1, *x.shape[-3:]))

        if mask is not None:
            mask = jnp.asarray(mask) != 0  # Flax's mask helpers give float 1/0
        out = pf.dot_product_attention(
            *flat, flatten_batch(bias), flatten_batch(mask), implementation=backend
        )
        return out.reshape(query.shape)

    return attend
