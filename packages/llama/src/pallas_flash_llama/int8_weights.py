"""int8 matmul weights for inference: per-channel symmetric quantization at load time, and the
matmul that takes them (`dot`).

A weight ``w [inputs..., outputs...]`` (`model.param_shapes`, a layer's stacked over ``layers``
in front) becomes an `Int8Weight`: ``values = round(w / scales)`` int8 and ``scales
[outputs...]`` float32, ``max |w| / 127`` over the input axes of each output channel (per
layer). `quantize_params` quantizes every matmul weight of a model (`INPUT_AXES`): the
projections, the MLP and the output head; the token embedding (a lookup, not a matmul) and
the norms stay as they are.

`dot` quantizes the activations too, per token (symmetric, ``max |x| / 127`` over the axes
the matmul contracts), multiplies int8 by int8 into int32 (v5e's MXU runs int8 at twice its
bfloat16 rate) and scales the result by both scales. The weights' HBM bytes halve against
bfloat16, which is what a memory-bound decode step reads. The other way, activations in the
compute dtype against the int8 values converted in the matmul, halves the same bytes but
keeps the bfloat16 rate: the static v5e estimate put it behind at a decode step's size and
at a prefill's (docs/llama.md).
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from pallas_flash_llama import sharding
from pallas_flash_llama.config import LlamaConfig

INPUT_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1,
              "lm_head": 1}  # fmt: skip
"""The matmul weights and how many of their leading axes (after ``layers``) are inputs."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """A quantized matmul weight (module doc).

    Attributes:
      values: ``[leading..., inputs..., outputs...]`` int8.
      scales: ``[leading..., outputs...]`` float32: ``w = values * scales``, broadcast over the
        input axes.
    """

    values: jax.Array
    scales: jax.Array


def quantize(w: jax.Array, leading: int, inputs: int) -> Int8Weight:
    """``w`` with ``leading`` axes (stacked layers) before its ``inputs`` input axes,
    quantized per output channel (and per leading index)."""
    w32 = w.astype(jnp.float32)
    axes = tuple(range(leading, leading + inputs))
    scales = jnp.max(jnp.abs(w32), axis=axes, keepdims=True) / 127
    scales = jnp.where(scales == 0, 1.0, scales)  # an all-zero channel stays zero
    values = jnp.clip(jnp.round(w32 / scales), -127, 127).astype(jnp.int8)
    return Int8Weight(values, jnp.squeeze(scales, axes))


def is_int8(x: object) -> bool:
    """Whether ``x`` is an `Int8Weight` (an ``is_leaf`` for tree maps that stop at one)."""
    return isinstance(x, Int8Weight)


def _each_weight(tree: dict, weight: Callable[[Any, int, int], Any]) -> dict:
    """``tree`` (shaped like the parameters) with ``weight(leaf, leading, inputs)`` in place
    of each matmul weight of `INPUT_AXES` (``leading``: 1 for a layer's, stacked)."""
    out = dict(tree)
    if "lm_head" in tree:
        out["lm_head"] = weight(tree["lm_head"], 0, INPUT_AXES["lm_head"])
    out["layers"] = {name: weight(w, 1, INPUT_AXES[name]) if name in INPUT_AXES else w
                     for name, w in tree["layers"].items()}  # fmt: skip
    return out


def quantize_params(params: dict, mesh: Mesh | None = None, config: LlamaConfig | None = None):
    """``params`` (`model.init_params`'s layout) with every weight of `INPUT_AXES` an
    `Int8Weight`; with ``mesh`` (and ``config``), placed as `shardings` says."""

    def convert(params: dict) -> dict:
        return _each_weight(params, quantize)

    if mesh is None:
        return jax.jit(convert)(params)
    if config is None:
        raise ValueError("config: needed with a mesh, to place the quantized weights")
    return jax.jit(convert, out_shardings=shardings(config, mesh))(params)


def _is_axes(x: object) -> bool:
    return isinstance(x, tuple)


def shardings(config: LlamaConfig, mesh: Mesh) -> dict:
    """The sharding of every parameter of `quantize_params`'s output: an `Int8Weight`'s values
    as the weight's (`sharding.param_axes`), its scales as its output axes."""

    def split(axes: tuple[str, ...], leading: int, inputs: int) -> Int8Weight:
        return Int8Weight(axes, (*axes[:leading], *axes[leading + inputs :]))

    axes = _each_weight(sharding.param_axes(config), split)
    return jax.tree.map(lambda a: NamedSharding(mesh, sharding.spec(a)), axes, is_leaf=_is_axes)


def dot(spec: str, x: jax.Array, w: jax.Array | Int8Weight, **kwargs) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for ``w`` an array or an `Int8Weight` (module doc: ``x``
    quantized per token, an int8 x int8 matmul into int32, then both scales); ``kwargs`` go
    to einsum (``preferred_element_type``: also the result's dtype with int8 weights, else
    ``x``'s)."""
    if not isinstance(w, Int8Weight):
        return jnp.einsum(spec, x, w, **kwargs)
    inputs, result = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    if "..." in x_axes:
        unused = iter(a for a in string.ascii_letters if a not in spec)
        named = "".join(next(unused) for _ in range(x.ndim - len(x_axes) + 3))
        x_axes, result = x_axes.replace("...", named), result.replace("...", named)
    contracted = tuple(i for i, a in enumerate(x_axes) if a in w_axes and a not in result)
    x32 = x.astype(jnp.float32)
    x_scales = jnp.max(jnp.abs(x32), axis=contracted, keepdims=True) / 127
    x_scales = jnp.where(x_scales == 0, 1.0, x_scales)
    x_values = jnp.clip(jnp.round(x32 / x_scales), -127, 127).astype(jnp.int8)
    product = jnp.einsum(f"{x_axes},{w_axes}->{result}", x_values, w.values,
                         preferred_element_type=jnp.int32)  # fmt: skip
    x_kept = "".join(a for i, a in enumerate(x_axes) if i not in contracted)
    w_kept = "".join(a for a in w_axes if a in result)
    x_scales = _as_result(jnp.squeeze(x_scales, contracted), x_kept, result)
    out = product.astype(jnp.float32) * x_scales * _as_result(w.scales, w_kept, result)
    return out.astype(kwargs.get("preferred_element_type") or x.dtype)


def _as_result(scales: jax.Array, axes: str, result: str) -> jax.Array:
    """``scales`` (its axes named by ``axes``) laid out to broadcast over ``result``'s."""
    ordered = "".join(a for a in result if a in axes)
    scales = jnp.einsum(f"{axes}->{ordered}", scales)
    return scales.reshape([scales.shape[ordered.index(a)] if a in axes else 1 for a in result])
