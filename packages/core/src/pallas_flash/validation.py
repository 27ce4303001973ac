"""Input validation, done once in core for every backend.

Every check raises `InvalidInputError` naming the argument, what it got and what was
expected. Only static facts (shapes, dtypes, Python values) are checked; decode's inputs are
checked in `pallas_flash.decode_validation`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash import context_layout
from pallas_flash.errors import InvalidInputError
from pallas_flash.specs import SegmentIds


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the head and sequence axes sit in rank-4 q/k/v arrays (batch first, head_dim last)."""

    heads_axis: int
    seq_axis: int

    def describe(self, heads: str, seq: str) -> str:
        """Returns e.g. ``[batch, q_heads, q_len, head_dim]`` for this layout."""
        axes = ["batch", "", "", "head_dim"]
        axes[self.heads_axis] = heads
        axes[self.seq_axis] = seq
        return "[" + ", ".join(axes) + "]"


HEADS_MAJOR = Layout(heads_axis=1, seq_axis=2)
"""``[batch, heads, seq, head_dim]``: the layout of ``pf.attention``."""
SEQ_MAJOR = Layout(heads_axis=2, seq_axis=1)
"""``[batch, seq, heads, head_dim]``: the layout of ``jax.nn.dot_product_attention``."""


class AttentionDims(NamedTuple):
    """The sizes of a validated attention call."""

    batch: int
    q_heads: int
    q_len: int
    kv_heads: int
    kv_len: int
    head_dim: int  # of q and k
    v_head_dim: int  # of v and the output


def fail(name: str, got: str, expected: str) -> InvalidInputError:
    return InvalidInputError(f"{name}: expected {expected}, got {got}")


def check_rank(name: str, x: Any, rank: int, layout_text: str) -> None:
    if jnp.ndim(x) != rank:
        raise fail(name, f"shape {tuple(jnp.shape(x))}", f"rank {rank} {layout_text}")
    if any(d < 1 for d in jnp.shape(x)):
        raise fail(name, f"shape {tuple(jnp.shape(x))}", f"{layout_text} with every size >= 1")


def check_float_dtypes(names: tuple[str, ...], arrays: tuple[Any, ...]) -> None:
    dtype = jnp.result_type(arrays[0])
    for name, x in zip(names, arrays, strict=True):
        x_dtype = jnp.result_type(x)
        if not jnp.issubdtype(x_dtype, jnp.floating):
            raise fail(name, f"dtype {x_dtype}", "a floating dtype (bfloat16, float16, float32)")
        if x_dtype != dtype:
            raise fail(name, f"dtype {x_dtype}", f"the dtype of {names[0]}, {dtype}")


def check_heads(name: str, q_heads: int, kv_heads: int) -> None:
    """Checks that ``kv_heads`` (of the argument ``name``) divides ``q_heads`` (GQA/MQA)."""
    if q_heads % kv_heads:
        raise fail(
            name,
            f"{kv_heads} kv heads for {q_heads} query heads",
            "q_heads to be a multiple of kv_heads",
        )


def check_qkv(
    q: Any,
    k: Any,
    v: Any,
    *,
    names: tuple[str, str, str] = ("q", "k", "v"),
    layout: Layout = HEADS_MAJOR,
) -> AttentionDims:
    """Checks the ranks, sizes and dtypes of q, k and v and returns their sizes: v has k's
    shape but for its ``head_dim``, which may differ from q's and k's (MLA: 192 and 128)."""
    q_name, k_name, v_name = names
    q_text = layout.describe("q_heads", "q_len")
    kv_text = layout.describe("kv_heads", "kv_len")
    check_rank(q_name, q, 4, q_text)
    check_rank(k_name, k, 4, kv_text)
    check_rank(v_name, v, 4, kv_text)
    if jnp.shape(v)[:3] != jnp.shape(k)[:3]:
        raise fail(
            v_name, f"shape {jnp.shape(v)}", f"the shape of {k_name} but head_dim, {jnp.shape(k)}"
        )
    q_shape, k_shape = jnp.shape(q), jnp.shape(k)
    dims = AttentionDims(
        batch=q_shape[0],
        q_heads=q_shape[layout.heads_axis],
        q_len=q_shape[layout.seq_axis],
        kv_heads=k_shape[layout.heads_axis],
        kv_len=k_shape[layout.seq_axis],
        head_dim=q_shape[3],
        v_head_dim=jnp.shape(v)[3],
    )
    if k_shape[0] != dims.batch:
        raise fail(k_name, f"shape {k_shape}", f"batch {dims.batch} (from {q_name})")
    if k_shape[3] != dims.head_dim:
        raise fail(k_name, f"shape {k_shape}", f"head_dim {dims.head_dim} (from {q_name})")
    check_heads(k_name, dims.q_heads, dims.kv_heads)
    check_float_dtypes(names, (q, k, v))
    return dims


def check_segment_ids(segment_ids: Any, dims: AttentionDims) -> SegmentIds:
    """Checks segment id shapes against the call's sizes; returns them as int32."""
    if not isinstance(segment_ids, SegmentIds):
        raise fail(
            "segment_ids", type(segment_ids).__name__, "a pf.SegmentIds(q=..., kv=...) or None"
        )
    checked = []
    for field, length in (("q", dims.q_len), ("kv", dims.kv_len)):
        ids = getattr(segment_ids, field)
        expected = (dims.batch, length)
        if tuple(jnp.shape(ids)) != expected:
            raise fail(
                f"segment_ids.{field}",
                f"shape {tuple(jnp.shape(ids))}",
                f"shape {expected} [batch, {field}_len]",
            )
        if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
            raise fail(f"segment_ids.{field}", f"dtype {jnp.result_type(ids)}", "an integer dtype")
        checked.append(jnp.asarray(ids, dtype=jnp.int32))
    return SegmentIds(*checked)


def check_context_parallel(mesh: Any, layout: Any, exchange: Any, dims: AttentionDims) -> None:
    """Checks a context-parallel call: a ``jax.sharding.Mesh``, a known layout and exchange,
    and queries and keys of one sequence that the mesh's devices (times the layout's chunks
    per device) divide."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise fail("mesh", type(mesh).__name__, "a jax.sharding.Mesh or None")
    if layout not in context_layout.LAYOUTS:
        raise fail("context_layout", repr(layout), f"one of {context_layout.LAYOUTS}")
    if exchange not in context_layout.EXCHANGES:
        raise fail("context_exchange", repr(exchange), f"one of {context_layout.EXCHANGES}")
    if dims.kv_len != dims.q_len:
        raise fail("k", f"kv_len {dims.kv_len}", f"kv_len == q_len ({dims.q_len}) with a mesh")
    parts = mesh.size * context_layout.pieces(layout)
    if dims.q_len % parts:
        raise fail(
            "q",
            f"q_len {dims.q_len}",
            f"a multiple of the mesh's {mesh.size} devices x {context_layout.pieces(layout)} "
            f"chunks each ({layout})",
        )


def check_sinks(sinks: Any, dims: AttentionDims) -> jax.Array:
    """Checks that sinks is a floating ``[q_heads]`` array; returns it as an array."""
    shape = tuple(jnp.shape(sinks))
    if shape != (dims.q_heads,):
        raise fail("sinks", f"shape {shape}", f"shape ({dims.q_heads},) [q_heads]")
    if not jnp.issubdtype(jnp.result_type(sinks), jnp.floating):
        raise fail("sinks", f"dtype {jnp.result_type(sinks)}", "a floating dtype")
    return jnp.asarray(sinks)


def check_broadcastable(name: str, x: jax.Array, dims: AttentionDims) -> jax.Array:
    """Checks a bias or mask against ``[batch, q_heads, q_len, kv_len]``; returns it as rank 4.

    As in jax, the leading axes a lower-rank bias or mask leaves out are taken as size 1.
    """
    if x.ndim < 4:
        x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    target = (dims.batch, dims.q_heads, dims.q_len, dims.kv_len)
    if x.ndim != 4 or any(d not in (1, t) for d, t in zip(x.shape, target, strict=True)):
        raise InvalidInputError(
            f"{name}: expected rank <= 4 broadcastable to {target} "
            f"[batch, q_heads, q_len, kv_len], got shape {x.shape}"
        )
    return x


def check_bias(bias: Any, dims: AttentionDims) -> jax.Array:
    """An additive bias: floating, broadcastable to ``[batch, q_heads, q_len, kv_len]``;
    returned as rank 4 (`check_broadcastable`)."""
    bias = check_broadcastable("bias", jnp.asarray(bias), dims)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise InvalidInputError(f"bias: expected a floating dtype, got dtype {bias.dtype}")
    return bias


def _check_non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise fail(name, repr(value), "a non-negative int")
    return int(value)


def check_window(
    sliding_window: Any, *, causal: bool, name: str = "sliding_window"
) -> tuple[int, int] | None:
    """Normalises ``w`` or ``(left, right)`` to ``(left, right)``; right is 0 when causal."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, tuple | list):
        if len(sliding_window) != 2:
            raise fail(name, repr(sliding_window), "an int w or a pair (left, right)")
        left = _check_non_negative_int(f"{name}[0]", sliding_window[0])
        right = _check_non_negative_int(f"{name}[1]", sliding_window[1])
    else:
        left = right = _check_non_negative_int(name, sliding_window)
    return (left, 0 if causal else right)


def _check_python_float(name: str, value: Any) -> float:
    if isinstance(value, (bool, jax.core.Tracer)):
        raise fail(name, repr(value), "a Python float known at trace time")
    scalar_array = hasattr(value, "dtype") and jnp.ndim(value) == 0
    if not (isinstance(value, numbers.Real) or scalar_array):
        raise fail(name, repr(value), "a real number")
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise fail(name, repr(value), "a real number") from None
    if not math.isfinite(result):
        raise fail(name, repr(value), "a finite number")
    return result


def check_softcap(softcap: Any) -> float | None:
    """Checks that softcap is None or a finite number > 0."""
    if softcap is None:
        return None
    result = _check_python_float("softcap", softcap)
    if result <= 0:
        raise fail("softcap", repr(softcap), "a number > 0")
    return result


def check_sm_scale(sm_scale: Any, head_dim: int, *, name: str = "sm_scale") -> float:
    """Returns sm_scale as a float, defaulting to ``1 / sqrt(head_dim)``."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return _check_python_float(name, sm_scale)


def check_causal(causal: Any, *, name: str = "causal") -> bool:
    """Checks that causal is a bool."""
    if not isinstance(causal, bool | np.bool_):
        raise fail(name, repr(causal), "a bool")
    return bool(causal)
