"""Property-based parity: random shapes and features drawn from the backend's capabilities."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_flash_conformance.calls import Case
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close


@st.composite
def cases(draw, capabilities: frozenset[str]) -> Case:
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4])) if "gqa" in capabilities else 1
    windows = st.one_of(st.integers(0, 24), st.tuples(st.integers(0, 24), st.integers(0, 24)))
    return Case(
        batch=draw(st.integers(1, 2)),
        q_heads=kv_heads * group,
        kv_heads=kv_heads,
        q_len=draw(st.integers(1, 80)),
        kv_len=draw(st.integers(1, 80)),
        head_dim=draw(st.sampled_from([64, 128])),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        causal="causal" in capabilities and draw(st.booleans()),
        sliding_window=draw(st.none() | windows) if "sliding_window" in capabilities else None,
        softcap=draw(st.none() | st.floats(0.5, 20.0)) if "softcap" in capabilities else None,
        segments=draw(st.none() | st.integers(1, 3)) if "segment_ids" in capabilities else None,
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.requires("attention")
def test_random_calls_match_reference(backend) -> None:
    @settings(
        max_examples=25,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(case=cases(backend.capabilities))
    def check(case: Case) -> None:
        q, k, v = case.arrays()
        expected = case.reference(q, k, v)
        assert_close(case.run(backend.name, q, k, v), expected, FORWARD_TOLERANCE[case.dtype])

    check()
