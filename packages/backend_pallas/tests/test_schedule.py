"""The block schedules against a brute-force visibility matrix (pure Python, no kernel)."""

from __future__ import annotations

import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash.masking import positional_mask
from pallas_flash_pallas.blocks.schedule import BlockKind, KvSchedule, QSchedule

SPECS = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window": (40, 20)},
    "window-left-only": {"window": (0, 130)},
    "causal-window": {"causal": True, "window": (100, 0)},
}
LENGTHS = [(300, 300), (300, 140), (130, 400), (1, 256), (256, 1), (1000, 1000)]
BLOCKS = [(128, 128), (256, 128), (128, 256)]


def _visible(spec: pf.AttentionSpec, q_len: int, kv_len: int) -> np.ndarray:
    """``[q_len, kv_len]``: True where a valid query row sees a valid key."""
    mask = positional_mask(np.arange(q_len)[:, None], np.arange(kv_len)[None, :], spec)
    return np.ones((q_len, kv_len), bool) if mask is None else np.asarray(mask)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize(("q_len", "kv_len"), LENGTHS)
@pytest.mark.parametrize(("block_q", "block_kv"), BLOCKS)
@pytest.mark.parametrize("aligned", ["end", "start"])
def test_schedule_visits_exactly_the_visible_blocks(
    name: str, q_len: int, kv_len: int, block_q: int, block_kv: int, aligned: str
) -> None:
    q_offset = kv_len - q_len if aligned == "end" else 0
    spec = pf.AttentionSpec(sm_scale=1.0, q_offset=q_offset, **SPECS[name])
    schedule = KvSchedule(spec, q_len, kv_len, min(block_q, q_len), min(block_kv, kv_len))
    visible = _visible(spec, q_len, kv_len)
    bq, bkv = schedule.block_q, schedule.block_kv
    assert schedule.num_steps == max(
        1, max(schedule.count(i) for i in range(schedule.num_q_blocks))
    )
    for i in range(schedule.num_q_blocks):
        rows = visible[i * bq : (i + 1) * bq]
        blocks = [rows[:, kb * bkv : (kb + 1) * bkv] for kb in range(schedule.num_kv_blocks)]
        wanted = [kb for kb, keys in enumerate(blocks) if keys.any()]
        steps = range(schedule.num_steps)
        visited = [schedule.kv_block(i, j) for j in steps if schedule.is_visited(i, j)]
        assert visited == wanted, f"q block {i}"
        held = [schedule.kv_block(i, j) for j in steps]
        assert all(0 <= kb < schedule.num_kv_blocks for kb in held)
        # Past the visited blocks the index map stays on the last one: no new DMA.
        last = visited[-1] if visited else held[0]
        assert all(kb == last for kb in held[len(visited) :]), f"q block {i}"
        for kb in visited:
            _check_kind(schedule, i, kb, blocks[kb])


def _check_kind(schedule, i: int, kv_block: int, pairs: np.ndarray) -> None:
    """``pairs``: the visibility of the block's valid rows and keys."""
    full_size = pairs.shape == (schedule.block_q, schedule.block_kv)
    kind = schedule.kind(i, kv_block)
    assert (kind == BlockKind.FULL) == (full_size and pairs.all()), f"block ({i}, {kv_block})"
    if kind == BlockKind.DIAGONAL:  # relative row r sees exactly relative keys 0..r
        assert full_size, f"block ({i}, {kv_block})"
        r, c = np.indices(pairs.shape)
        assert (pairs == (c <= r)).all(), f"block ({i}, {kv_block})"


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize(("q_len", "kv_len"), LENGTHS)
@pytest.mark.parametrize(("block_q", "block_kv"), BLOCKS)
@pytest.mark.parametrize("aligned", ["end", "start"])
@pytest.mark.parametrize("chunk_blocks", [None, 1, 2])
def test_q_schedule_visits_exactly_the_visible_blocks(
    name: str,
    q_len: int,
    kv_len: int,
    block_q: int,
    block_kv: int,
    aligned: str,
    chunk_blocks: int | None,
) -> None:
    q_offset = kv_len - q_len if aligned == "end" else 0
    spec = pf.AttentionSpec(sm_scale=1.0, q_offset=q_offset, **SPECS[name])
    schedule = QSchedule(
        spec, q_len, kv_len, min(block_q, q_len), min(block_kv, kv_len), chunk_blocks
    )
    visible = _visible(spec, q_len, kv_len)
    bq, bkv = schedule.block_q, schedule.block_kv
    per_chunk = schedule.blocks_per_chunk
    assert (
        schedule.num_chunks * per_chunk
        >= schedule.num_q_blocks
        > (schedule.num_chunks - 1) * per_chunk
    )
    steps = range(schedule.num_steps)
    for kb in range(schedule.num_kv_blocks):
        keys = visible[:, kb * bkv : (kb + 1) * bkv]
        for c in range(schedule.num_chunks):
            chunk = range(c * per_chunk, min((c + 1) * per_chunk, schedule.num_q_blocks))
            wanted = [i for i in chunk if keys[i * bq : (i + 1) * bq].any()]
            visited = [schedule.q_block(c, kb, s) for s in steps if schedule.is_visited(c, kb, s)]
            assert visited == wanted, f"kv block {kb}, chunk {c}"
            held = [schedule.q_block(c, kb, s) for s in steps]
            assert all(i in chunk for i in held), f"kv block {kb}, chunk {c}"
            last = visited[-1] if visited else held[0]
            assert all(i == last for i in held[len(visited) :]), f"kv block {kb}, chunk {c}"
            for i in visited:
                _check_kind(schedule, i, kb, keys[i * bq : (i + 1) * bq])


def test_kinds_lists_the_variants_the_kernel_needs() -> None:
    full, masked, diagonal = BlockKind.FULL, BlockKind.MASKED, BlockKind.DIAGONAL
    spec = pf.AttentionSpec(sm_scale=1.0)
    assert KvSchedule(spec, 256, 256, 128, 128).kinds == {full}
    assert KvSchedule(spec, 256, 300, 128, 128).kinds == {full, masked}
    # The forward's first step writes its accumulators: it has its own variants.
    assert KvSchedule(spec, 256, 300, 128, 128).step_kinds(first=True) == {full}
    assert KvSchedule(spec, 256, 300, 128, 128).step_kinds() == {full, masked}
    causal = pf.AttentionSpec(sm_scale=1.0, causal=True)
    assert KvSchedule(causal, 128, 128, 128, 128).kinds == {diagonal}
    assert KvSchedule(causal, 512, 512, 128, 128).kinds == {full, diagonal}
    shifted = pf.AttentionSpec(sm_scale=1.0, causal=True, q_offset=64)
    assert KvSchedule(shifted, 448, 512, 128, 128).kinds == {full, masked}
    assert KvSchedule(causal, 512, 512, 128, 128).visited_blocks == 10
    assert not KvSchedule(causal, 512, 512, 128, 128).visits_every_step
    assert QSchedule(causal, 512, 512, 128, 128).visited_blocks == 10
    assert QSchedule(causal, 512, 512, 128, 128).num_steps == 4
    assert QSchedule(causal, 512, 512, 128, 128, chunk_blocks=2).num_steps == 2
    # A partial last query block needs a mask in the backward.
    assert KvSchedule(spec, 300, 256, 128, 128).kinds == {full, masked}
