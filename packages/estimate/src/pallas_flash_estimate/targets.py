"""TPU targets: the topology to compile for and the per-chip figures estimates divide by.

Figures are Google's published per-chip specifications. ``clock_hz`` is derived, not
published: peak bf16 FLOP/s / (MXUs x width x width x 2 flops per multiply-add x rows an MXU
takes a cycle), e.g. v5e: 197e12 / (4 x 128 x 128 x 2 x 1) = 1.5 GHz; v6e (2 MXUs of 256 x
256, as jax's ``tpu_info`` and its listings' ``mxu0``/``mxu1`` say, each taking 2 rows a
cycle: `Target.mxu_rows_per_cycle`): 918e12 / (2 x 256 x 256 x 2 x 2) = 1.75 GHz; v7x (per
device, half a chip: the same two MXUs): 1,153.5e12 / (2 x 256 x 256 x 2 x 2) = 2.2 GHz.

v7x's rows a cycle are not visible in its listings: its compiler issues vmatmuls into the
MXUs' result buffers (``mrb[i]``) every other bundle and the MXU drains them at its own rate.
Two rows a cycle at 2.2 GHz is the reading its measurements allow: at four rows and 1.1 GHz
the compiler's own bundle count of tokamax's forward (``bf16[1,16384,16,128]``, full, at its
timed blocks: 10.24 M bundles a kernel) would take 9.3 ms, 1.66x its measured 5.62 ms, and
a static schedule cannot outlast the device.

Collectives between chips are modelled, not scheduled, by one model
(`pallas_flash_estimate.program.ici`), for whole programs and the bench's kernel rows alike.
It uses the slice's torus: ``torus`` gives its sides, ``ici_wraparound`` whether they wrap
(v5e: only the full 16x16 pod), ``ici_link_bandwidth`` one link's bandwidth in one direction
(v5e: 1,600 Gbit/s per chip over 4 links is 50 GB/s per link and direction). Each collective
costs ``collective_latency`` and each of its ring steps ``ici_hop_latency``: both are
assumptions, not published figures (10 us, an allowance for the synchronisation and launch of
a small all-reduce, and 1 us per hop).

Prices are on-demand list prices per chip-hour from the Google Cloud TPU pricing page as last
recorded by this project (2025; not re-checked when this table was written, 2026-11-21, as no
network was available); pass ``--price`` to use your own.
"""

from __future__ import annotations

import dataclasses

MiB = 1 << 20
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Target:
    """One TPU slice to compile for: a call runs on one chip, or on up to ``chips`` chips of
    the topology (see ``Workload.chips``)."""

    name: str
    generation: str
    """The TPU generation (`pallas_flash.tpu.GENERATIONS`): the kernels are built for it."""
    topology: str
    """Topology name for ``jax.experimental.topologies.get_topology_desc``."""
    chips_per_host_bounds: tuple[int, int, int]
    chips: int
    peak_flops: float
    """Peak bf16 FLOP/s of one device."""
    hbm_bytes: int
    hbm_bandwidth: float
    """Bytes/s of one device."""
    vmem_bytes: int
    """VMEM of one TensorCore (the kernels' own table: `pallas_flash.tpu.GENERATIONS`)."""
    clock_hz: float
    ici_bandwidth: float
    """Interconnect bytes/s out of one chip, all links together, one direction."""
    ici_link_bandwidth: float
    """Interconnect bytes/s of one link in one direction."""
    collective_latency: float
    """Assumed seconds each collective costs beyond its bytes (see the module docstring)."""
    price_per_chip_hour: float
    """US dollars, on-demand list price (see the module docstring)."""
    torus: tuple[int, ...] = (2, 2)
    """The slice's sides in chips (the ICI torus or mesh the chips form)."""
    ici_wraparound: bool = False
    """Whether the torus sides wrap around (a ring runs both ways round each)."""
    ici_hop_latency: float = 1e-6
    """Assumed seconds per ring step of a collective (see the module docstring)."""
    mxu_rows_per_cycle: int = 1
    """Rows of a ``vmatmul``'s left operand one MXU takes a cycle: 1 on the 128-wide MXUs of
    v4, v5e and v5p (a 16-row bfloat16 vmatmul every 16 bundles on one MXU where the compiler
    keeps it busy), 2 on v6e's and v7x's 256-wide ones (on v6e one every 8 bundles)."""

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Target:
        """The target `to_json` wrote (its tuples come back from JSON lists)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


_V5E = dict(
    generation="v5e",
    topology="v5e:2x2",
    chips_per_host_bounds=(2, 2, 1),
    peak_flops=197e12,
    hbm_bytes=16 * GiB,
    hbm_bandwidth=819e9,
    vmem_bytes=128 * MiB,
    clock_hz=197e12 / (4 * 128 * 128 * 2),
    ici_bandwidth=1600e9 / 8,  # 1,600 Gbit/s per chip
    ici_link_bandwidth=1600e9 / 8 / 4,
    collective_latency=10e-6,
    price_per_chip_hour=1.20,
)


def _v5e_slice(x: int, y: int, host: tuple[int, int, int]) -> Target:
    """A v5e slice of x by y chips (compiled as that topology)."""
    options = dict(_V5E, topology=f"v5e:{x}x{y}", chips_per_host_bounds=host)
    return Target(name=f"v5e-{x * y}", chips=x * y, torus=(x, y), ici_wraparound=x == y == 16,
                  **options)  # fmt: skip


def _v7x() -> Target:
    """One v7x (Ironwood) TensorCore: a v7x chip shows up as two devices without megacore
    (jax's ``tpu_info``: 2 TensorCores, 2 MXUs of 256 each, 64 MiB VMEM a core), so, as for
    v4, every figure is one device's, half a chip's. Chip figures are Google's published
    ones: 4,614 TFLOP/s FP8 (2,307 bf16), 192 GiB of HBM at 7.37 TB/s, 1.2 TB/s of ICI both
    ways; the links' count (6, a 3D torus as v5p's) is an assumption. No list price was
    recorded by this project: NaN (pass ``--price``)."""
    chip_flops = 2307e12
    return Target(
        name="v7x",
        generation="v7x",
        topology="tpu7x:2x2x1",
        chips_per_host_bounds=(2, 2, 1),
        chips=1,
        peak_flops=chip_flops / 2,
        hbm_bytes=192 * GiB // 2,
        hbm_bandwidth=7370e9 / 2,
        vmem_bytes=64 * MiB,
        clock_hz=chip_flops / 2 / (2 * 256 * 256 * 2 * 2),
        mxu_rows_per_cycle=2,
        ici_bandwidth=1200e9 / 2 / 2,
        ici_link_bandwidth=1200e9 / 2 / 2 / 6,
        collective_latency=10e-6,
        price_per_chip_hour=float("nan"),
    )


TARGETS = {
    "v5e-1": Target(name="v5e-1", chips=1, **_V5E),
    "v5e-4": Target(name="v5e-4", chips=4, **_V5E),
    "v5e-8": _v5e_slice(2, 4, (2, 4, 1)),
    "v5e-16": _v5e_slice(4, 4, (2, 2, 1)),
    "v5e-256": _v5e_slice(16, 16, (2, 2, 1)),
    # One v4 chip shows up as two devices (one per TensorCore) in this topology: figures are
    # per TensorCore, half a chip's.
    "v4": Target(
        name="v4",
        generation="v4",
        topology="v4:2x2x1",
        chips_per_host_bounds=(2, 2, 1),
        chips=1,
        peak_flops=275e12 / 2,
        hbm_bytes=16 * GiB,
        hbm_bandwidth=1228e9 / 2,
        vmem_bytes=16 * MiB,
        clock_hz=275e12 / (2 * 4 * 128 * 128 * 2),
        ici_bandwidth=2400e9 / 8,
        ici_link_bandwidth=2400e9 / 8 / 6,
        collective_latency=10e-6,
        price_per_chip_hour=3.22 / 2,
    ),
    "v5p": Target(
        name="v5p",
        generation="v5p",
        topology="v5p:2x2x1",
        chips_per_host_bounds=(2, 2, 1),
        chips=1,
        peak_flops=459e12,
        hbm_bytes=95 * GiB,
        hbm_bandwidth=2765e9,
        vmem_bytes=64 * MiB,
        clock_hz=459e12 / (2 * 4 * 128 * 128 * 2),
        ici_bandwidth=4800e9 / 8,
        ici_link_bandwidth=4800e9 / 8 / 6,
        collective_latency=10e-6,
        price_per_chip_hour=4.20,
    ),
    "v6e": Target(
        name="v6e",
        generation="v6e",
        topology="v6e:2x2",
        chips_per_host_bounds=(2, 2, 1),
        chips=1,
        peak_flops=918e12,
        hbm_bytes=32 * GiB,
        hbm_bandwidth=1640e9,
        vmem_bytes=128 * MiB,
        clock_hz=918e12 / (2 * 256 * 256 * 2 * 2),
        mxu_rows_per_cycle=2,
        ici_bandwidth=3584e9 / 8,
        ici_link_bandwidth=3584e9 / 8 / 4,
        collective_latency=10e-6,
        price_per_chip_hour=2.70,
    ),
    "v7x": _v7x(),
}


SENSITIVITY = {
    "ICI bandwidth x0.7": lambda t: dataclasses.replace(
        t, ici_bandwidth=0.7 * t.ici_bandwidth, ici_link_bandwidth=0.7 * t.ici_link_bandwidth
    ),
    "collective latency x3": lambda t: dataclasses.replace(
        t, collective_latency=3 * t.collective_latency, ici_hop_latency=3 * t.ici_hop_latency
    ),
    "HBM at 90 %": lambda t: dataclasses.replace(t, hbm_bandwidth=0.9 * t.hbm_bandwidth),
}
"""The model's constants no measurement here checks, each moved the way that hurts: the
interconnect at 70 % of its published bandwidth, every collective's latency and hop three
times the assumed, HBM at 90 % of its published bandwidth. Whole programs are estimated under
each beside the headline (`whole_program.program_estimate`)."""

DEFAULT_TARGET = "v5e-4"
"""A v5e slice of 2x2 chips: calls on one chip, and decoding over all four."""
