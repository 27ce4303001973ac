"""A drop-in for ``jax.nn.dot_product_attention`` that runs on any installed backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash import validation
from pallas_flash.api import run_attention
from pallas_flash.errors import InvalidInputError
from pallas_flash.specs import AttentionSpec, SegmentIds
from pallas_flash.validation import SEQ_MAJOR, AttentionDims

# Segment ids that encode sequence lengths: valid queries and keys share id 0, while padded
# queries and padded keys get ids that match nothing, so padded query rows give zeros.
_VALID, _PADDED_QUERY, _PADDED_KEY = 0, -1, -2


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """``jax.nn.dot_product_attention`` with ``implementation`` naming a Pallas-Flash backend.

    Same arguments, ``[batch, seq, heads, head_dim]`` layout (or ``[seq, heads, head_dim]``)
    and results as jax's function: causal and window masks are aligned to the first key,
    ``bias`` and ``mask`` are broadcastable to ``[batch, q_heads, q_len, kv_len]``, and query
    rows past ``query_seq_lengths`` are zero. One difference: a query row that sees no key
    returns zeros here, where jax returns the mean of the values.

    Sequence lengths are served through the backend's ``segment_ids`` capability.

    Raises:
      InvalidInputError: a malformed argument.
      UnsupportedFeatureError: the backend cannot serve an argument (``bias``, ``mask``, ...).
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    dims = validation.check_qkv(
        query, key, value, names=("query", "key", "value"), layout=SEQ_MAJOR
    )
    causal = validation.check_causal(is_causal, name="is_causal")
    spec = AttentionSpec(
        sm_scale=validation.check_sm_scale(scale, dims.head_dim, name="scale"),
        causal=causal,
        q_offset=0,
        window=validation.check_window(local_window_size, causal=causal, name="local_window_size"),
    )
    if bias is not None:
        bias = validation.check_bias(bias, dims)
    if mask is not None:
        mask = validation.check_broadcastable("mask", jnp.asarray(mask), dims)
        if mask.dtype != jnp.bool_:
            raise InvalidInputError(
                f"mask: expected dtype bool (True = attend), got dtype {mask.dtype}"
            )
    segment_ids = _lengths_as_segment_ids(query_seq_lengths, key_value_seq_lengths, dims)
    out = run_attention(
        *(jnp.swapaxes(x, 1, 2) for x in (query, key, value)),
        spec,
        dims,
        backend=implementation,
        segment_ids=segment_ids,
        bias=bias,
        mask=mask,
    )
    out = jnp.swapaxes(out, 1, 2)
    return out[0] if unbatched else out


def _lengths_as_segment_ids(
    query_seq_lengths: jax.Array | None,
    key_value_seq_lengths: jax.Array | None,
    dims: AttentionDims,
) -> SegmentIds | None:
    """Encodes per-sequence lengths as segment ids (see ``_VALID``)."""
    if query_seq_lengths is None and key_value_seq_lengths is None:
        return None

    def ids(name: str, lengths: jax.Array | None, seq_len: int, padded_id: int) -> jax.Array:
        positions = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
        if lengths is None:
            return jnp.full((dims.batch, seq_len), _VALID, dtype=jnp.int32)
        lengths = jnp.asarray(lengths)
        if lengths.shape != (dims.batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise InvalidInputError(
                f"{name}: expected an integer array of shape ({dims.batch},) [batch], "
                f"got shape {lengths.shape} dtype {lengths.dtype}"
            )
        return jnp.where(positions < lengths[:, None], _VALID, padded_id).astype(jnp.int32)

    return SegmentIds(
        q=ids("query_seq_lengths", query_seq_lengths, dims.q_len, _PADDED_QUERY),
        kv=ids("key_value_seq_lengths", key_value_seq_lengths, dims.kv_len, _PADDED_KEY),
    )
