"""A kernel under each estimate: schedule, MXU floor, critical path, weight pushes charged
without overlap, and its DMA bytes, on trimmed real dumps (see test_critical_path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pallas_flash_estimate.cost import dma, kernel_cost, llo, spread
from pallas_flash_estimate.evaluate import bundle_listing, bundle_weights

SAMPLES = Path(__file__).parent / "samples" / "llo"


@pytest.fixture(scope="module")
def pallas() -> llo.KernelSchedule:
    (schedule,) = llo.load_dump(SAMPLES / "pallas_forward_4096").values()
    return schedule


@pytest.fixture(scope="module")
def splash() -> llo.KernelSchedule:
    (schedule,) = llo.load_dump(SAMPLES / "splash_forward_4096").values()
    return schedule


def test_pushes_are_counted_per_mxu_like_the_matmuls(splash) -> None:
    """Splash issues one weight push per eight matmuls: its 192 pushes per step, all kept in
    the sample, 48 on each MXU."""
    pushes = bundle_weights.unit_prefixes(splash.listing.bundles, "vmatpush", lambda _ins: 1)
    assert {unit: prefix[-1] for unit, prefix in pushes.items()} == {
        "mxu0": 48,
        "mxu1": 48,
        "mxu2": 48,
        "mxu3": 48,
    }
    assert splash.opcodes["vmatpush"] == 192
    assert spread.kernel_estimates(splash).pushes == 192


def test_critical_path_per_grid_step(pallas) -> None:
    """Pallas forward, grid (1, 16, 1, 4): region 47 runs on the 16 first kv steps, region 51
    on the 48 others, the guard's own code on the 64 steps, the loop's on all 66 iterations."""
    found = spread.kernel_estimates(pallas)
    expected = 16 * 16882 + 48 * 16916 + 16 * 21 + 64 * 8 + 66 * (21 + 1) + 1
    assert found.ranges["critical_path"] == (expected, expected) == (1_084_381, 1_084_381)
    assert expected / 64 == pytest.approx(16_943, abs=1)  # per step; the MXU floor is 16,384
    assert found.warnings == ()


def test_estimates_of_a_kernel_with_an_undecided_region(splash) -> None:
    """Splash's block-mask region reads memory: skipped (min) or run on all 256 steps (max)."""
    ranges = spread.kernel_estimates(splash).ranges
    assert ranges["schedule"] == (splash.executed_bundles_min, splash.executed_bundles_max)
    assert ranges["mxu"] == (0, 102_400)  # the trimmed sample's matmuls, all in that region
    low, high = ranges["critical_path"]
    assert high - low == 256 * 4292
    assert high == 1_115_893
    # pushes at 8 and 16 cycles on the busiest MXU, or the bundles when more
    assert ranges["push8"] == (28_386, 200_704)
    assert ranges["push16"] == (28_386, 299_008)


def test_push_charge_takes_the_busiest_mxu(pallas) -> None:
    ranges = spread.kernel_estimates(pallas).ranges
    assert ranges["schedule"] == (9040, 9040) and ranges["mxu"] == (5120, 5120)
    assert ranges["push8"] == (9040, 9040)  # still under the bundles
    assert ranges["push16"] == (10_240, 10_240)


def test_dma_transfers_and_their_steps(pallas) -> None:
    """K and V blocks (1024 x 128 bf16) every step, the Q block (4096 x 128) and the output
    once per head: the buffer-slot counters the predicates compare are evaluated per step."""
    found = dma.transfers(pallas.listing)
    assert [(t.opcode, t.bytes) for t in found] == [
        ("dma.hbm_to_vmem", 256 << 10),
        ("dma.hbm_to_vmem", 256 << 10),
        ("dma.hbm_to_vmem", 1 << 20),
        ("dma.vmem_to_hbm", 1 << 20),
    ]
    assert found[0].guard == "!%p198173_p12" and found[0].into_vmem
    runs = [llo.executed_instruction(pallas.listing, t.bundle, t.guard) for t in found]
    assert runs == [(64, 64), (64, 64), (16, 16), (16, 16)]
    # Q, K, V and O of 1 x 16 x 4096 x 128 bf16 once: the least the workload moves
    assert dma.executed_bytes(pallas.listing) == (64 << 20, 64 << 20)


def test_kernel_entry_resolves_every_estimate(splash) -> None:
    entry = spread.kernel_entry(splash, kernel_cost.FULL_GRID)  # no mask
    assert entry["cycles"] == 102_400
    assert entry["cycles_from"].startswith("data-dependent regions run on 100% of the steps")
    assert entry["estimates"] == {
        "schedule": 94_690,
        "mxu": 102_400,
        "critical_path": 1_115_893,
        "push8": 200_704,
        "push16": 299_008,
    }
    # splash reads q, k and v from VMEM (XLA prefetched them): only outputs leave by DMA
    assert entry["dma_bytes"] == 64 * (256 << 10) + 3 * (512 << 10)
    assert entry["pushes"] == 192 and entry["steps"] == 256
    causal = spread.kernel_entry(splash, kernel_cost.FullGrid(causal=True))
    assert causal["estimates"]["critical_path"] == 1_115_893 - 4292 * (256 - 160)


def test_a_strided_dma_general_counts_its_granules() -> None:
    """A ``[kv_heads, block, head_dim]`` block of a ``[batch, kv_heads, length, head_dim]`` cache
    (splitkv's decode, v5e): ``dma.general`` of 16384 granules of 32 bytes, 512 KiB."""
    line = (
        "  0x0   : > { %6167 = dma.general (%p6677_p5), /*src=*/%s340_s17, "
        "/*size_in_granules=*/16384, /*dst=*/%s342_s5, /*dst_syncflagno=*/%s6753_s20, "
        "/*src_syncflagno=*/%s6577_s29, /*stridedescaddr=*/[#allocation17], "
        "/*overrides=*/%s4830_s4, /*dst_syncflagno_1=*/0 }"
    )
    listing = bundle_listing.parse_bundles(line + "\n", "k.1")
    (found,) = dma.transfers(listing)
    assert (found.opcode, found.bytes, found.guard) == ("dma.general", 512 << 10, "%p6677_p5")
