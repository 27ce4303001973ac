"""One attention call described once, run both on a backend and on the float64 reference.

A `Case` holds the shapes and the ``pf.attention`` keyword arguments; it builds the
inputs, calls the backend under test, and translates the same arguments to the reference's
explicit form (the default scale, the end-aligned query offset, the normalised window).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs, reference


@dataclasses.dataclass(frozen=True)
class Case:
    """Shapes ``(batch, q_heads, kv_heads, q_len, kv_len, head_dim)``, a dtype and features
    (``v_head_dim``: v's own head_dim, as MLA's 128 beside q and k's 192)."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str = "float32"
    causal: bool = False
    sm_scale: float | None = None
    sliding_window: int | tuple[int, int] | None = None
    softcap: float | None = None
    segments: int | None = None
    """Number of packed segments per row (random boundaries), or None for no segment ids."""
    v_head_dim: int | None = None
    """v's head_dim where it differs from q's and k's; None: the same."""
    sinks: bool = False
    """Attention sinks: a float32 logit per query head (`sink_logits`)."""
    q_scale: float = 1.0
    """Multiplies q, e.g. 100 for large-magnitude logits."""
    seed: int = 0

    def arrays(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q ``[batch, q_heads, q_len, head_dim]``; k ``[batch, kv_heads, kv_len, head_dim]``;
        v ``[batch, kv_heads, kv_len, v_head_dim]``."""
        q, k, v = inputs.qkv(
            self.batch,
            self.q_heads,
            self.kv_heads,
            self.q_len,
            self.kv_len,
            self.head_dim,
            self.dtype,
            self.seed,
        )
        if self.v_head_dim is not None:
            shape = (self.batch, self.kv_heads, self.kv_len, self.v_head_dim)
            v = inputs.normal(self.seed + 2, shape, self.dtype)
        return (q * self.q_scale).astype(q.dtype), k, v

    def segment_ids(self) -> pf.SegmentIds | None:
        if self.segments is None:
            return None
        return pf.SegmentIds(
            q=inputs.segment_ids(self.seed, self.batch, self.q_len, self.segments),
            kv=inputs.segment_ids(self.seed, self.batch, self.kv_len, self.segments),
        )

    def sink_logits(self) -> jax.Array | None:
        """``[q_heads]`` float32 around 4, about a row's log-sum-exp over ~100 keys (so the
        sink takes a good share of each row), or None without sinks."""
        if not self.sinks:
            return None
        return inputs.normal(self.seed + 5, (self.q_heads,), scale=2.0) + 4.0

    def run(
        self, backend: str, q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None = None
    ) -> jax.Array:
        """``pf.attention`` on the backend under test (``sinks``: default `sink_logits`)."""
        return pf.attention(
            q,
            k,
            v,
            causal=self.causal,
            sm_scale=self.sm_scale,
            segment_ids=self.segment_ids(),
            sliding_window=self.sliding_window,
            softcap=self.softcap,
            sinks=self.sink_logits() if sinks is None else sinks,
            backend=backend,
        )

    def reference_kwargs(self) -> dict[str, Any]:
        """The same call in the reference's explicit terms."""
        window = self.sliding_window
        if isinstance(window, int):
            window = (window, window)
        if window is not None and self.causal:
            window = (window[0], 0)
        ids = self.segment_ids()
        return dict(
            sm_scale=1 / math.sqrt(self.head_dim) if self.sm_scale is None else self.sm_scale,
            causal=self.causal,
            q_offset=self.kv_len - self.q_len,
            window=window,
            softcap=self.softcap,
            segment_ids=None if ids is None else (ids.q, ids.kv),
            sinks=self.sink_logits(),
        )

    def reference(self, q: jax.Array, k: jax.Array, v: jax.Array) -> np.ndarray:
        return reference.attention(q, k, v, **self.reference_kwargs())

    def required(self) -> set[str]:
        """The capabilities this call uses."""
        used = {
            "attention": True,
            "gqa": self.q_heads != self.kv_heads,
            "causal": self.causal,
            "sliding_window": self.sliding_window is not None,
            "softcap": self.softcap is not None,
            "segment_ids": self.segments is not None,
            "sinks": self.sinks,
            "value_head_dim": self.v_head_dim not in (None, self.head_dim),
        }
        return {name for name, needed in used.items() if needed}

    def param(self, test_id: str, *extra: str) -> Any:
        """This case as a ``pytest.param`` marked with the capabilities it needs."""
        return pytest.param(self, id=test_id, marks=pytest.mark.requires(*self.required(), *extra))
