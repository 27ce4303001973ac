"""Forward parity of ``pf.attention`` against the float64 reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance.calls import Case
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, LARGE_LOGIT_TOLERANCE, assert_close

# (batch, q_heads, kv_heads, q_len, kv_len, head_dim): edge shapes every backend must handle.
SHAPES = {
    "square-128": (1, 2, 2, 128, 128, 128),
    "batch2-len130-d64": (2, 2, 2, 130, 130, 64),
    "q7-kv130": (1, 2, 2, 7, 130, 64),
    "q130-kv7": (1, 2, 2, 130, 7, 64),
    "len1": (1, 1, 1, 1, 1, 64),
    "len1000": (1, 1, 1, 1000, 1000, 64),
    "d96": (1, 2, 2, 64, 64, 96),
    "d256": (1, 2, 2, 64, 64, 256),
    "gqa2": (1, 4, 2, 64, 96, 128),
    "gqa8": (1, 16, 2, 32, 48, 64),
    "mqa": (2, 8, 1, 40, 72, 128),
}

# Features on three alignments (square, fewer queries than keys, more queries than keys),
# with as many query heads as kv heads and with two query heads per kv head.
FEATURES = {
    "causal": dict(causal=True),
    "window-int": dict(sliding_window=9),
    "window-pair": dict(sliding_window=(12, 3)),
    "causal-window": dict(causal=True, sliding_window=(20, 5)),
    "softcap": dict(softcap=1.5, q_scale=4.0),
    "segment-ids": dict(segments=3),
    "sm-scale": dict(sm_scale=0.3),
    "sinks": dict(sinks=True),
    "causal-sinks": dict(causal=True, sinks=True),  # q-long: rows with a sink and no key
    "all": dict(causal=True, sliding_window=17, softcap=3.0, segments=2),
}
ALIGNMENTS = {"square": (96, 96), "q-short": (33, 96), "q-long": (96, 40)}


def _check(backend: str, case: Case, tolerance: dict[str, float] = FORWARD_TOLERANCE) -> None:
    q, k, v = case.arrays()
    assert_close(case.run(backend, q, k, v), case.reference(q, k, v), tolerance[case.dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [Case(*shape).param(name) for name, shape in SHAPES.items()])
def test_shapes(backend, case: Case, dtype: str) -> None:
    _check(backend.name, dataclasses.replace(case, dtype=dtype))


# v's head_dim of its own: MLA's 192 / 128 (with GQA, causal q-long rows that see no key),
# a value wider than the key, and both with partial blocks
VALUE_HEAD_DIMS = {
    "mla-192-128": Case(1, 4, 2, 96, 96, 192, v_head_dim=128),
    "mla-causal-q-long": Case(2, 4, 2, 96, 40, 192, causal=True, v_head_dim=128),
    "v-wider-len130": Case(1, 2, 2, 130, 130, 64, v_head_dim=128),
    "mla-window-softcap-sinks": Case(
        1, 2, 2, 64, 96, 192, sliding_window=9, softcap=3.0, sinks=True, v_head_dim=128
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [case.param(name) for name, case in VALUE_HEAD_DIMS.items()])
def test_value_head_dim(backend, case: Case, dtype: str) -> None:
    _check(backend.name, dataclasses.replace(case, dtype=dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "case",
    [
        Case(2, q_heads, 2, q_len, kv_len, 64, **kwargs).param(f"{name}{heads}-{alignment}")
        for name, kwargs in FEATURES.items()
        for alignment, (q_len, kv_len) in ALIGNMENTS.items()
        for heads, q_heads in (("", 2), ("-gqa", 4))
    ],
)
def test_features(backend, case: Case, dtype: str) -> None:
    _check(backend.name, dataclasses.replace(case, dtype=dtype))


@pytest.mark.requires("causal")
def test_causal_rows_before_the_first_key_are_zero(backend) -> None:
    """With more queries than keys, bottom-right causal leaves the first rows with no key."""
    case = Case(1, 2, 2, 48, 16, 64, causal=True)
    out = np.asarray(case.run(backend.name, *case.arrays()))
    assert np.isfinite(out).all()
    assert (out[:, :, : 48 - 16] == 0).all(), "rows that see no key must be exactly zero"
    assert (np.abs(out[:, :, 48 - 16 :]).max(axis=-1) > 0).all(), "rows that see keys must not"


@pytest.mark.requires("segment_ids")
def test_query_whose_segment_has_no_key_is_zero(backend) -> None:
    q, k, v = Case(2, 2, 2, 40, 40, 64).arrays()
    ids = pf.SegmentIds(q=np.zeros((2, 40), np.int32), kv=np.zeros((2, 40), np.int32))
    ids.q[:, :5] = 7  # no key has segment 7
    out = np.asarray(pf.attention(q, k, v, segment_ids=ids, backend=backend.name))
    assert np.isfinite(out).all()
    assert (out[:, :, :5] == 0).all(), "rows that see no key must be exactly zero"
    assert (np.abs(out[:, :, 5:]).max(axis=-1) > 0).all(), "rows that see keys must not"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "case",
    [
        Case(1, 2, 2, 64, 64, 64, q_scale=100.0).param("plain"),
        Case(1, 2, 2, 64, 64, 64, q_scale=100.0, causal=True).param("causal"),
        Case(1, 2, 2, 64, 64, 64, q_scale=100.0, softcap=30.0).param("softcap"),
    ],
)
def test_large_logits(backend, case: Case, dtype: str) -> None:
    """q scaled by 100: logits of magnitude ~1e3 must not overflow to inf or NaN."""
    _check(backend.name, dataclasses.replace(case, dtype=dtype), LARGE_LOGIT_TOLERANCE)
