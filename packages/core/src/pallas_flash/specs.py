"""The validated, static settings of one attention or decode call.

Core validates and normalises the user's arguments once and hands backends these frozen,
hashable specs (usable as static arguments of ``jax.jit``) together with the arrays.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax


class SegmentIds(NamedTuple):
    """Segment ids for packed sequences: a query sees only keys with the same id.

    Attributes:
      q: ``[batch, q_len]`` int32 segment id of each query.
      kv: ``[batch, kv_len]`` int32 segment id of each key.
    """

    q: jax.Array
    kv: jax.Array


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static settings of one attention call.

    Positions: query row ``i`` sits at key position ``i + q_offset``. ``pf.attention`` aligns
    queries to the end of the keys (``q_offset = kv_len - q_len``); ``dot_product_attention``
    aligns them to the start (``q_offset = 0``), as ``jax.nn.dot_product_attention`` does.

    Attributes:
      sm_scale: scores are ``(q @ k^T) * sm_scale``.
      causal: a query at position ``p`` sees keys ``j <= p``.
      q_offset: key position of query row 0.
      window: ``(left, right)``: a query at position ``p`` sees keys
        ``p - left <= j <= p + right``; ``right`` is already 0 when ``causal``.
      softcap: if set, ``scores = softcap * tanh(scores / softcap)``, applied before masking.
    """

    sm_scale: float
    causal: bool = False
    q_offset: int = 0
    window: tuple[int, int] | None = None
    softcap: float | None = None


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Static settings of one decode call.

    Attributes:
      sm_scale: scores are ``(q @ k^T) * sm_scale``.
      softcap: if set, ``scores = softcap * tanh(scores / softcap)``, applied before masking.
    """

    sm_scale: float
    softcap: float | None = None


@dataclasses.dataclass(frozen=True)
class RaggedSpec:
    """Static settings of one ragged attention call.

    Attributes:
      sm_scale: scores are ``(q @ k^T) * sm_scale``.
      softcap: if set, ``scores = softcap * tanh(scores / softcap)``, applied before masking.
      window: if set, ``w``: a new token at position ``p`` sees positions ``p - w <= j <= p``
        (every token sees only positions up to its own: causal).
    """

    sm_scale: float
    softcap: float | None = None
    window: int | None = None
