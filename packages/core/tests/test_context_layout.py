"""The chunk layouts of context parallelism."""

from __future__ import annotations

import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import context_layout


def test_zigzag_gives_each_device_an_early_and_a_late_chunk() -> None:
    tokens = np.arange(16)[None, None, :, None]  # [batch, heads, seq, head_dim]: positions
    zigzag = np.asarray(pf.to_zigzag(tokens, devices=4))[0, 0, :, 0]
    # 8 chunks of 2; device d (4 tokens each) holds chunks d and 7 - d
    assert zigzag.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    np.testing.assert_array_equal(pf.from_zigzag(pf.to_zigzag(tokens, 4), 4), tokens)
    assert context_layout.chunk_ids(1, 4, "zigzag") == [1, 6]
    assert context_layout.chunk_ids(1, 4, "contiguous") == [1]


@pytest.mark.parametrize("layout", context_layout.LAYOUTS)
def test_every_causal_pair_is_counted_once(layout: str) -> None:
    """Over the ring, device d meets every device's chunks once: the visible pairs (key chunk
    not after the query chunk) sum to the whole causal triangle, and zigzag shares them
    out evenly."""
    devices = 4
    work = []
    for d in range(devices):
        mine = context_layout.chunk_ids(d, devices, layout)
        theirs = [c for e in range(devices) for c in context_layout.chunk_ids(e, devices, layout)]
        work.append(sum(1 for a in mine for b in theirs if b <= a))
    chunks = devices * context_layout.pieces(layout)
    assert sum(work) == chunks * (chunks + 1) // 2
    if layout == "zigzag":
        assert len(set(work)) == 1


def test_ring_pair_kinds() -> None:
    """Zigzag on 4 devices: every device meets 2 diagonal pairs (its own chunks at step 0),
    7 unmasked and 7 skipped of its 16; contiguous loads the last device most (its own chunk,
    then every earlier one unmasked) and the first least."""
    for d in range(4):
        assert context_layout.ring_pair_kinds(d, 4, "zigzag") == {
            "skip": 7, "diagonal": 2, "unmasked": 7}  # fmt: skip
    assert context_layout.ring_pair_kinds(3, 4, "contiguous") == {
        "skip": 0, "diagonal": 1, "unmasked": 3}  # fmt: skip
    assert context_layout.ring_pair_kinds(0, 4, "contiguous") == {
        "skip": 3, "diagonal": 1, "unmasked": 0}  # fmt: skip
    assert [int(context_layout.pair_kind(a, 2)) for a in (1, 2, 3)] == [0, 1, 2]
