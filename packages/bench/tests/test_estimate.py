"""A row's derived figures, and what the bench's workloads tell the kernel cost model (their
occupancy: a ragged decode's filled blocks and copied pages)."""

from __future__ import annotations

import math

import pytest

from pallas_flash_bench.kernels import row_figures
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.cost import kernel_cost
from pallas_flash_estimate.program import ici
from pallas_flash_estimate.targets import TARGETS

V5E = TARGETS["v5e-1"]


def test_static_figures_mfu_follows_from_cycles() -> None:
    w = Workload("forward", 4096)
    cycles = 1621 * 1024
    figures = row_figures.derive(
        w,
        V5E,
        1.2,
        static_cycles=cycles,
        has_kernels=True,
        compiler_flops=None,
        compiler_bytes=None,
        copy_bytes=0,
    )
    seconds = cycles / V5E.clock_hz
    assert figures["latency_seconds"] == {"value": pytest.approx(seconds), "source": "static"}
    assert figures["mfu"]["value"] == pytest.approx(w.useful_flops / seconds / V5E.peak_flops)
    assert 0.5 < figures["mfu"]["value"] < 0.7  # 512x512 blocks: ~60 % as measured by hand
    tokens_per_second = 4096 / seconds
    assert figures["tokens_per_dollar"]["value"] == pytest.approx(tokens_per_second * 3600 / 1.2)


def test_memory_bound_programs_take_the_memory_time() -> None:
    w = Workload("decode", 131072, q_heads=32, kv_heads=8)
    figures = row_figures.derive(
        w,
        V5E,
        1.2,
        static_cycles=1000,
        has_kernels=True,
        compiler_flops=None,
        compiler_bytes=None,
        copy_bytes=0,
    )
    assert figures["latency_seconds"]["source"] == "model"
    assert figures["latency_seconds"]["value"] == pytest.approx(w.min_hbm_bytes / V5E.hbm_bandwidth)
    assert figures["hbm_bandwidth_use"]["value"] == pytest.approx(1.0)


def test_programs_without_kernels_use_the_compilers_counts() -> None:
    w = Workload("forward", 8192, causal=True)
    figures = row_figures.derive(
        w,
        V5E,
        1.2,
        static_cycles=None,
        has_kernels=False,
        compiler_flops=5.6e11,
        compiler_bytes=2.2e10,
        copy_bytes=0,
    )
    assert figures["hbm_bytes"] == {"value": 2.2e10, "source": "compiler"}
    assert figures["compute_seconds"] == {
        "value": pytest.approx(5.6e11 / V5E.peak_flops),
        "source": "model",
    }
    assert figures["latency_seconds"]["value"] == pytest.approx(2.2e10 / V5E.hbm_bandwidth)


def test_copy_trap_bytes_are_charged_twice() -> None:
    w = Workload("forward", 1024)
    with_copies = row_figures.derive(
        w,
        V5E,
        1.2,
        static_cycles=1,
        has_kernels=True,
        compiler_flops=None,
        compiler_bytes=None,
        copy_bytes=1000,
    )
    assert with_copies["hbm_bytes"]["value"] == w.min_hbm_bytes + 2000


def test_xla_programs_keep_the_compilers_bytes_with_a_static_schedule() -> None:
    w = Workload("forward", 4096)
    figures = row_figures.derive(
        w, V5E, 1.2, static_cycles=1_444_662, has_kernels=False, compiler_flops=None,
        compiler_bytes=3.4e9, copy_bytes=0,
    )  # fmt: skip
    assert figures["hbm_bytes"] == {"value": 3.4e9, "source": "compiler"}
    assert figures["compute_seconds"]["source"] == "static"
    assert figures["latency_seconds"]["value"] == pytest.approx(3.4e9 / V5E.hbm_bandwidth)


V5E_4 = TARGETS["v5e-4"]


def _entry(opcode: str, size: int, group: int = 4) -> dict:
    return {"name": opcode, "opcode": opcode, "bytes": size, "group": group}


def test_a_rows_collectives_are_timed_by_the_estimators_torus_model() -> None:
    collectives = [_entry("all-reduce", 33_024), _entry("all-gather", 4000)]
    figures = row_figures.derive(
        Workload("decode", 8192, chips=4), V5E_4, 1.2, static_cycles=1000, has_kernels=True,
        compiler_flops=None, compiler_bytes=None, copy_bytes=0, collectives=collectives,
    )  # fmt: skip
    # v5e-4 is a 2x2 slice without wraparound: a group of 4 spans both sides, one link each,
    # and takes (2 - 1) + (2 - 1) ring steps
    traffic = (2 * 0.75 * 33_024 + 0.75 * 4000) / (2 * V5E_4.ici_link_bandwidth)
    latency = 2 * (V5E_4.collective_latency + 2 * V5E_4.ici_hop_latency)
    assert figures["collective_seconds"]["value"] == pytest.approx(latency + traffic)
    assert V5E_4.torus == (2, 2) and not V5E_4.ici_wraparound
    assert V5E_4.ici_link_bandwidth == 50e9 and V5E_4.collective_latency == 10e-6


def test_decode_over_four_chips_splits_the_bytes_and_adds_its_collectives() -> None:
    one = Workload("decode", 131072, q_heads=32, kv_heads=8)
    four = Workload("decode", 131072, q_heads=32, kv_heads=8, chips=4)
    collectives = [_entry("all-reduce", 128), _entry("all-reduce", 16_512)]
    figures = row_figures.derive(
        four, V5E_4, 1.2, static_cycles=150_000, has_kernels=True, compiler_flops=None,
        compiler_bytes=None, copy_bytes=0, collectives=collectives,
    )  # fmt: skip
    memory = one.min_hbm_bytes / V5E_4.hbm_bandwidth / 4
    exchange = ici.entries_seconds(collectives, V5E_4)
    assert figures["memory_seconds"]["value"] == pytest.approx(memory)
    assert figures["collective_seconds"] == {"value": pytest.approx(exchange), "source": "model"}
    latency = {"value": pytest.approx(memory + exchange), "source": "model"}
    assert figures["latency_seconds"] == latency
    compute = 150_000 / V5E_4.clock_hz
    assert figures["latency_no_overlap_seconds"]["value"] == pytest.approx(
        compute + memory + exchange
    )
    dollars_per_second = 4 * 1.2 / 3600
    assert figures["tokens_per_dollar"]["value"] == pytest.approx(
        1 / (memory + exchange) / dollars_per_second
    )


def test_dma_cycles_at_the_hbm_bandwidth() -> None:
    # the pallas forward at N=4096 streams 64 MiB over its 64 grid steps
    cycles = row_figures.dma_cycles(64 << 20, V5E)
    assert cycles == pytest.approx((64 << 20) / 819e9 * V5E.clock_hz)
    assert cycles / 64 < 16_384  # 1 MiB per step hides under 16,384 cycles of matmuls


def test_spread_gives_latency_and_mfu_under_each_estimate() -> None:
    w = Workload("forward", 4096)
    memory = w.min_hbm_bytes / V5E.hbm_bandwidth
    cycles = {"schedule": 1_074_041, "push16": 1_572_864, "critical_path": None, "tiny": 10}
    out = row_figures.spread(w, V5E, cycles, memory, 0.0)
    seconds = 1_572_864 / V5E.clock_hz
    assert out["push16"]["latency_seconds"] == pytest.approx(seconds)
    assert out["push16"]["mfu"] == pytest.approx(w.useful_flops / seconds / V5E.peak_flops)
    assert 0.66 < out["push16"]["mfu"] < 0.67
    assert 0.97 < out["schedule"]["mfu"] < 0.98
    assert out["critical_path"] == {"cycles": None, "latency_seconds": None, "mfu": None}
    assert out["tiny"]["latency_seconds"] == pytest.approx(memory)  # memory-bound


def test_ragged_decode_runs_its_undecided_regions_on_the_blocks_holding_tokens() -> None:
    w = Workload("decode", 8192, batch=2, lengths=(512, 8192))
    fraction = w.active_fraction(4)
    assert kernel_cost.undecided_fraction((2, 1, 4), False, w) == fraction < 1
    assert kernel_cost.undecided_fraction((1, 2, 8, 4), False, w) == fraction  # jax-paged's grid
    cycles, _ = kernel_cost.kernel_cycles(1000, 2000, 9, (2, 1, 4), False, occupancy=w)
    assert cycles == kernel_cost.between((1000, 2000), fraction)
    # without executed bundles: the full-grid figure on the active steps only
    cycles, how = kernel_cost.kernel_cycles(None, None, 8000, (2, 1, 4), False, occupancy=w)
    assert cycles == math.ceil(8000 * fraction) and "counted free" in how


def test_page_copying_kernels_read_the_pages_holding_tokens_block_specs_whole_blocks() -> None:
    """Lengths 1 and 1025 of a 2048-position cache in blocks of 1024: a block-spec kernel
    reads 1 + 2 blocks of 4, the kernel that copies 128-position pages 1 + 9 pages of 32."""
    w = Workload("decode", 2048, batch=2, lengths=(1, 1025), even_lengths=True)
    assert w.sequence_lengths.tolist() == [1, 1025]
    grid = (2, 2)
    assert kernel_cost.copied_fraction("pallas_flash_split_kv_decode.3", grid, w) == 3 / 4
    contiguous = "pallas_flash_split_kv_decode_contiguous_pages.7"
    assert kernel_cost.copied_fraction(contiguous, grid, w) == 10 / 32
    full = Workload("decode", 2048, batch=2)  # no lengths: every position, every block
    assert kernel_cost.copied_fraction(contiguous, grid, full) == 1.0


def test_paged_kernel_reads_the_pages_the_lengths_use() -> None:
    w = Workload("decode", 2048, batch=2, lengths=(1, 1025), even_lengths=True,
                 cache="paged", page_size=256)  # fmt: skip
    assert w.page_fraction(999) == (1 + 5) / 16  # a paged cache's own pages
    assert kernel_cost.copied_fraction("pallas_flash_split_kv_decode_paged", (2, 2), w) == 6 / 16


def test_even_lengths_are_every_length_of_the_range_once() -> None:
    w = Workload("decode", 2048, batch=1024, lengths=(1025, 2048), even_lengths=True)
    assert sorted(w.sequence_lengths.tolist()) == list(range(1025, 2049))


def test_every_target_holds_the_vmem_its_kernels_are_sized_for() -> None:
    """The estimator's targets (which import none of our packages) and the kernels' own table
    (`pallas_flash.tpu.GENERATIONS`) give each generation the same VMEM."""
    from pallas_flash.tpu import GENERATIONS

    for target in TARGETS.values():
        assert target.vmem_bytes == GENERATIONS[target.generation].vmem_bytes, target.name
