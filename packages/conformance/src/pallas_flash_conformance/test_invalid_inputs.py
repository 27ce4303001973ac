"""Bad inputs raise InvalidInputError naming the argument, whichever backend is selected."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs

Q, K, V = inputs.qkv(2, 4, 2, 16, 24, 64)
QD = inputs.normal(3, (2, 4, 64))
CACHE = inputs.normal(4, (2, 2, 32, 64))
LENGTHS = np.array([32, 5], np.int32)
SEGMENTS = pf.SegmentIds(np.zeros((2, 16), np.int32), np.zeros((2, 24), np.int32))


def _attention(q=Q, k=K, v=V, **kwargs):
    return lambda backend: pf.attention(q, k, v, backend=backend, **kwargs)


def _decode(q=QD, k=CACHE, v=CACHE, lengths=LENGTHS, **kwargs):
    return lambda backend: pf.decode(q, k, v, lengths, backend=backend, **kwargs)


def _dpa(**kwargs):
    q, k, v = (x.swapaxes(1, 2) for x in (Q, K, V))
    return lambda backend: pf.dot_product_attention(q, k, v, implementation=backend, **kwargs)


# name: (argument the message must name, the bad call)
BAD_CALLS = {
    "q-rank-3": ("q", _attention(q=Q[0])),
    "k-rank-5": ("k", _attention(k=K[None])),
    "v-shape": ("v", _attention(v=V[:, :, :-1])),
    "v-heads": ("v", _attention(v=V[:, :1])),
    "batch-mismatch": ("k", _attention(k=K[:1], v=V[:1])),
    "head-dim-mismatch": ("k", _attention(k=K[..., :32], v=V[..., :32])),
    "heads-not-multiple": ("k", _attention(q=inputs.normal(0, (2, 3, 16, 64)))),
    "dtype-mismatch": ("k", _attention(k=K.astype(jnp.bfloat16))),
    "integer-inputs": ("q", _attention(*(x.astype(jnp.int32) for x in (Q, K, V)))),
    "zero-length": ("q", _attention(q=Q[:, :, :0])),
    "causal-not-bool": ("causal", _attention(causal="yes")),
    "segment-q-shape": (
        "segment_ids.q",
        _attention(segment_ids=SEGMENTS._replace(q=SEGMENTS.q[:, :-1])),
    ),
    "segment-kv-shape": (
        "segment_ids.kv",
        _attention(segment_ids=SEGMENTS._replace(kv=SEGMENTS.kv[:1])),
    ),
    "segment-float": (
        "segment_ids.q",
        _attention(segment_ids=SEGMENTS._replace(q=SEGMENTS.q * 1.0)),
    ),
    "segment-tuple": ("segment_ids", _attention(segment_ids=(SEGMENTS.q, SEGMENTS.kv))),
    "softcap-zero": ("softcap", _attention(softcap=0.0)),
    "softcap-negative": ("softcap", _attention(softcap=-1.0)),
    "window-negative": ("sliding_window", _attention(sliding_window=-1)),
    "window-right-negative": ("sliding_window[1]", _attention(sliding_window=(3, -2))),
    "window-three": ("sliding_window", _attention(sliding_window=(1, 2, 3))),
    "window-float": ("sliding_window", _attention(sliding_window=2.5)),
    "sm-scale-nan": ("sm_scale", _attention(sm_scale=float("nan"))),
    "sinks-shape": ("sinks", _attention(sinks=np.zeros((2,), np.float32))),
    "sinks-per-kv-head-and-row": ("sinks", _attention(sinks=np.zeros((4, 16), np.float32))),
    "sinks-int": ("sinks", _attention(sinks=np.zeros((4,), np.int32))),
    "bias-not-broadcastable": ("bias", _attention(bias=np.zeros((1, 3, 16, 24), np.float32))),
    "bias-int": ("bias", _attention(bias=np.zeros((16, 24), np.int32))),
    "decode-q-rank-4": ("q", _decode(q=QD[None])),
    "decode-cache-rank-3": ("k_cache", _decode(k=CACHE[0])),
    "decode-v-shape": ("v_cache", _decode(v=CACHE[:, :, :-1])),
    "decode-heads": ("k_cache", _decode(q=inputs.normal(0, (2, 3, 64)))),
    "decode-dtype": ("v_cache", _decode(v=CACHE.astype(jnp.bfloat16))),
    "decode-lengths-shape": ("lengths", _decode(lengths=LENGTHS[:1])),
    "decode-lengths-float": ("lengths", _decode(lengths=LENGTHS * 1.0)),
    "decode-length-negative": ("lengths", _decode(lengths=np.array([-1, 3], np.int32))),
    "decode-length-over-max": ("lengths", _decode(lengths=np.array([33, 3], np.int32))),
    "decode-softcap": ("softcap", _decode(softcap=-3.0)),
    "dpa-bias-shape": ("bias", _dpa(bias=np.zeros((2, 4, 16, 5), np.float32))),
    "dpa-mask-dtype": ("mask", _dpa(mask=np.ones((2, 4, 16, 24), np.float32))),
    "dpa-query-lengths": (
        "query_seq_lengths",
        _dpa(query_seq_lengths=np.array([1, 2, 3], np.int32)),
    ),
    "dpa-window": ("local_window_size", _dpa(local_window_size=-2)),
}


@pytest.mark.parametrize("argument, call", list(BAD_CALLS.values()), ids=list(BAD_CALLS))
def test_bad_input_raises(backend, argument: str, call) -> None:
    with pytest.raises(pf.InvalidInputError) as error:
        call(backend.name)
    assert str(error.value).startswith(f"{argument}: expected"), str(error.value)
