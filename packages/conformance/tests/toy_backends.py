"""Two toy third-party backends, loaded into a pytest run of the suite with ``-p toy_backends``.

``toy`` is correct for what it declares (attention, causal); ``toy-unscaled`` declares the
same but forgets ``sm_scale``, so the suite must fail it.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import pallas_flash as pf
from pallas_flash.masking import positional_mask


class ToyBackend(pf.Backend):
    name = "toy"
    capabilities = frozenset({"attention", "causal"})
    platforms = frozenset({"cpu"})

    def scale(self, spec: pf.AttentionSpec) -> float:
        return spec.sm_scale

    def attention(self, q, k, v, spec, *, segment_ids=None, bias=None, mask=None) -> jax.Array:
        scores = jnp.einsum(
            "bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32, precision="highest"
        ) * self.scale(spec)
        visible = positional_mask(jnp.arange(q.shape[2])[:, None], jnp.arange(k.shape[2]), spec)
        if visible is not None:
            scores = jnp.where(visible, scores, -jnp.inf)
        row_max = jnp.max(scores, axis=-1, keepdims=True)
        probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
        row_sum = probs.sum(axis=-1, keepdims=True)
        probs = probs / jnp.where(row_sum == 0.0, 1.0, row_sum)
        out = jnp.einsum("bhqk,bhkd->bhqd", probs, v.astype(jnp.float32), precision="highest")
        return out.astype(q.dtype)


class UnscaledToyBackend(ToyBackend):
    name = "toy-unscaled"

    def scale(self, spec: pf.AttentionSpec) -> float:
        return 1.0  # the bug: ignores spec.sm_scale


@pf.hookimpl
def pallas_flash_backends() -> list[pf.Backend]:
    return [ToyBackend(), UnscaledToyBackend()]


def pytest_configure(config) -> None:
    """Registers this module as a Pallas-Flash plugin when pytest loads it."""
    pf.register_plugin(sys.modules[__name__])
