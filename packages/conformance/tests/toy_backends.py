"""Toy third-party backends, loaded into a pytest run of the suite with ``-p toy_backends``.

``toy`` is correct for what it declares (attention, causal); ``toy-unscaled`` declares the
same but forgets ``sm_scale``, so the suite must fail it; ``toy-racy`` computes ``toy``'s
answer but also runs a Pallas kernel that reads a DMA's destination before the DMA is done,
so the suite must fail it with the race detector on.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_flash as pf
from pallas_flash.interpret import interpret_params
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


def _racy_kernel(x_hbm, o_ref, buffer, semaphore) -> None:
    copy = pltpu.make_async_copy(x_hbm, buffer, semaphore)
    copy.start()
    o_ref[...] = buffer[...]  # the race: the copy may not have landed yet
    copy.wait()


class RacyToyBackend(ToyBackend):
    name = "toy-racy"

    def attention(self, q, k, v, spec, *, segment_ids=None, bias=None, mask=None) -> jax.Array:
        x = jnp.zeros((8, 128), jnp.int32)
        racy = pl.pallas_call(
            _racy_kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA],
            interpret=interpret_params(),
        )(x)
        out = super().attention(q, k, v, spec)
        return out + (0 * racy[0, 0]).astype(out.dtype)  # whatever it read, the answer stands


@pf.hookimpl
def pallas_flash_backends() -> list[pf.Backend]:
    return [ToyBackend(), UnscaledToyBackend(), RacyToyBackend()]


def pytest_configure(config) -> None:
    """Registers this module as a Pallas-Flash plugin when pytest loads it."""
    pf.register_plugin(sys.modules[__name__])
