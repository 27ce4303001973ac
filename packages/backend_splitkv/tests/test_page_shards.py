"""`local_pages`: each device's table and lengths of a pool split along its pages, checked
against a per-position count over random tables (every used position on exactly one device,
its local row where the table puts it)."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_flash_splitkv.page_shards import local_pages

PAGE_SIZE, PAGES_PER_SEQUENCE, DEVICES, COUNT = 4, 6, 3, 5  # a pool of 15 pages


@pytest.mark.parametrize("seed", range(5))
def test_each_used_position_is_on_one_device_at_its_page(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = 4
    lengths = np.array([0, 1, 9, PAGES_PER_SEQUENCE * PAGE_SIZE + 3])  # the last: clipped
    table = np.stack([rng.permutation(DEVICES * COUNT)[:PAGES_PER_SEQUENCE] for _ in range(batch)])
    table[1, 1:] = -1  # pages past a sequence's end may be anything
    table[2, 3:] = 99
    seen = {}
    for device in range(DEVICES):
        local_table, local_lengths = (
            np.asarray(x) for x in local_pages(table, lengths, device * COUNT, COUNT, PAGE_SIZE)
        )
        for b in range(batch):
            for p in range(local_lengths[b]):  # local position p: global page, row
                page = device * COUNT + local_table[b, p // PAGE_SIZE]
                seen.setdefault((b, int(page), p % PAGE_SIZE), []).append(device)
    expected = {
        (b, int(table[b, p // PAGE_SIZE]), p % PAGE_SIZE): [table[b, p // PAGE_SIZE] // COUNT]
        for b in range(batch)
        for p in range(min(lengths[b], PAGES_PER_SEQUENCE * PAGE_SIZE))
    }
    assert seen == expected


def test_pages_outside_every_slice_are_read_by_no_device() -> None:
    table = np.array([[0, -1, 20, 6]])
    lengths = np.array([4 * PAGE_SIZE])
    held = [int(local_pages(table, lengths, d * COUNT, COUNT, PAGE_SIZE)[1][0]) for d in (0, 1)]
    assert held == [PAGE_SIZE, PAGE_SIZE]  # pages 0 and 6; -1 and 20 are in no slice
