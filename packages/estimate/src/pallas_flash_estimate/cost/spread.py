"""How sure a kernel's static cycles are: the same kernel under each estimate.

All are read from one compiled program and weighed per grid step by the executed-bundle
evaluation of `llo` (predicated regions decided per step where the schedule allows):

``schedule``
    executed bundles, one per cycle;
``mxu``
    the busiest MXU's ``vmatmul`` cycles (16 per bf16 vreg, 8 per f32), weight pushes free;
``critical_path``
    the compiler's own latency model, the critical path of every executed basic block
    (`critical_path`): pushes 8 cycles, overlapped with the previous tile's matmuls;
``push8`` / ``push16``
    the schedule or the busiest MXU with every ``vmatpush`` charged 8 / 16 cycles on its MXU
    and overlapped with nothing: the sensitivity to the push overlap the other figures assume.

The headline (``cycles`` of a kernel entry) stays max(``schedule``, ``mxu``). Beside them, the
bytes the kernel's DMAs move (`dma`, at most: copies whose predicate the schedule cannot decide
counted; for a decode of ragged lengths, on the steps whose block holds a cached token), to
compare with its compute at the HBM bandwidth.
"""

from __future__ import annotations

import dataclasses

from pallas_flash_estimate.cost import dma, kernel_cost, llo
from pallas_flash_estimate.evaluate import bundle_weights, loop_trips
from pallas_flash_estimate.read import critical_path

__all__ = ["ESTIMATES", "KernelEstimates", "kernel_entry", "kernel_estimates"]

ESTIMATES = ("schedule", "mxu", "critical_path", "push8", "push16")
"""The kernel estimates, in report order (see the module docstring)."""

PUSH_CYCLES = (8, 16)
"""Cycles a ``vmatpush`` is charged in the no-overlap sensitivity lines."""

Range = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class KernelEstimates:
    """(min, max) per estimate over the whole kernel: undecided regions skipped / run; None
    where the schedule cannot be weighed (inner loops, unknown trip count, no file)."""

    ranges: dict[str, Range | None]
    dma_bytes: Range | None
    pushes: int  # vmatpush instructions of the grid loop body, every MXU
    warnings: tuple[str, ...] = ()


def kernel_estimates(
    schedule: llo.KernelSchedule, counts: loop_trips.BundleCounts | None = None
) -> KernelEstimates:
    """Every estimate of one kernel (its ``listing`` kept by `llo.build_schedule`); with
    ``counts``, each bundle weighed by its executions (`loop_trips.bundle_counts`: a kernel
    whose loops have trip counts read from memory, given from the workload)."""
    listing = schedule.listing
    assert listing is not None, "the schedule was built without its listing"
    bundles = listing.bundles

    def executed(prefixes) -> Range | None:
        if counts is not None:
            return loop_trips.busiest(counts, list(prefixes))
        return llo.executed_weight(listing, prefixes)

    ones = executed([list(range(len(bundles) + 1))])  # one per bundle
    matmuls = listing.mxu_prefixes
    pushes = bundle_weights.unit_prefixes(bundles, "vmatpush", lambda _ins: 1)
    ranges: dict[str, Range | None] = {
        "schedule": ones,
        "mxu": executed(matmuls.values()),
    }
    zeros = [0] * (len(bundles) + 1)
    for cost in PUSH_CYCLES:
        charged = [
            [m + cost * p for m, p in zip(matmuls.get(u, zeros), pushes.get(u, zeros), strict=True)]
            for u in sorted({*matmuls, *pushes})
        ]
        ranges[f"push{cost}"] = _larger(ones, executed(charged))
    warnings: list[str] = []
    ranges["critical_path"] = None
    if schedule.critical_path is not None:
        weights, warnings = critical_path.bundle_weights(
            schedule.critical_path, [b.comment for b in bundles]
        )
        ranges["critical_path"] = executed([bundle_weights.prefix_sums(weights)])
    loop = schedule.grid_loop
    lo, hi = (loop.start, loop.end) if loop is not None else (0, len(bundles) - 1)
    in_body = sum(p[hi + 1] - p[lo] for p in pushes.values())
    return KernelEstimates(
        ranges=ranges,
        dma_bytes=dma.executed_bytes(listing, counts),
        pushes=in_body,
        warnings=tuple(warnings),
    )


def _larger(a: Range | None, b: Range | None) -> Range | None:
    if a is None or b is None:
        return None
    return max(a[0], b[0]), max(a[1], b[1])


def kernel_entry(
    schedule: llo.KernelSchedule,
    occupancy: kernel_cost.Occupancy,
    trips: tuple[int, ...] | None = None,
) -> dict:
    """One Pallas kernel's row entry: its static schedule, headline ``cycles`` (see
    `kernel_cost.kernel_cycles`), ``estimates`` (cycles per estimate, `ESTIMATES`), ``dma_bytes``
    over all grid steps (at most) and ``pushes`` in the grid loop body.

    ``trips``: for a kernel with loops whose trip counts read memory, how often each runs over
    the whole kernel for this call (the bench's ``Subject.loop_trips``), in program order;
    see `_entry_with_trips`."""
    if trips is not None and schedule.executed_bundles_min is None:
        assert schedule.listing is not None, "the schedule was built without its listing"
        counts = loop_trips.bundle_counts(schedule.listing, trips)
        if not isinstance(counts, str):
            return _entry_with_trips(schedule, trips, counts, occupancy)
        schedule = dataclasses.replace(
            schedule, warnings=(*schedule.warnings, f"loop trip counts not applied: {counts}")
        )
    steps = schedule.grid_steps or schedule.trip_count or 1
    cycles, how = kernel_cost.kernel_cycles(
        schedule.executed_bundles_min,
        schedule.executed_bundles_max,
        steps * schedule.bundles_per_step,
        schedule.grid,
        occupancy.causal,
        schedule.executed_mxu_cycles_min,
        schedule.executed_mxu_cycles_max,
        occupancy,
    )
    found = kernel_estimates(schedule)
    fraction = kernel_cost.undecided_fraction(schedule.grid, occupancy.causal, occupancy)
    dma_bytes = _dma_bytes(found, occupancy, schedule.grid, fraction)
    return _entry(schedule, steps, cycles, how, found, dma_bytes, fraction)


def _dma_bytes(
    found: KernelEstimates, occupancy: kernel_cost.Occupancy, grid: tuple[int, ...] | None,
    fraction: float,
) -> int | None:  # fmt: skip
    """The bytes its DMAs move: at most, but for a call whose blocks past its data are not
    copied (a ragged decode), ``fraction`` of the undecided ones."""
    if found.dma_bytes is None:
        return None
    partly_filled = occupancy.filled_fraction(grid) is not None
    return kernel_cost.between(found.dma_bytes, fraction) if partly_filled else found.dma_bytes[1]


def _entry(
    schedule: llo.KernelSchedule,
    steps: int,
    cycles: int,
    how: str,
    found: KernelEstimates,
    dma_bytes: int | None,
    fraction: float,
) -> dict:
    return {
        "name": schedule.name,
        "bundles_per_step": schedule.bundles_per_step,
        "steps": steps,
        "grid": list(schedule.grid) if schedule.grid else None,
        "predicated_bundles": schedule.predicated_bundles,
        "utilization": {unit: schedule.utilization(unit) for unit in schedule.units},
        "spill_stores": schedule.spill_stores,
        "fill_loads": schedule.fill_loads,
        "mxu_ops": schedule.mxu_ops,
        "pushes": found.pushes,
        "vmem_bytes": schedule.vmem_bytes,
        "cycles": cycles,
        "cycles_from": how,
        "estimates": {
            name: kernel_cost.between(found.ranges[name], fraction) for name in ESTIMATES
        },
        # bundles in regions the schedule cannot decide (run on ``fraction`` of the steps)
        "undecided_bundles": _span(found.ranges["schedule"]),
        # at most: a copy whose predicate the schedule cannot decide is taken to run
        "dma_bytes": dma_bytes,
        "warnings": [*schedule.warnings, *found.warnings],
    }


def _span(bounds: Range | None) -> int | None:
    return None if bounds is None else bounds[1] - bounds[0]


def _entry_with_trips(
    schedule: llo.KernelSchedule,
    trips: tuple[int, ...],
    counts: loop_trips.BundleCounts,
    occupancy: kernel_cost.Occupancy,
) -> dict:
    """`kernel_entry` of a kernel whose loops without a trip count run ``trips`` times
    (`loop_trips`): every estimate weighs each bundle by its executions, and predicated regions
    that the schedule cannot decide run on the share of the runs that `kernel_entry` gives a
    kernel without such loops (`kernel_cost.undecided_fraction`: the causal or ragged share of
    the grid; all of them, their max, for a kernel whose grid says nothing of it, such as
    a ragged kernel's one step, where the prefetch of the next block runs on every block but
    the last), as do copies whose predicate it cannot decide (at most)."""
    found = kernel_estimates(schedule, counts)
    fraction = kernel_cost.undecided_fraction(schedule.grid, occupancy.causal, occupancy)
    bundles = found.ranges["schedule"]
    mxu = found.ranges["mxu"]
    assert bundles is not None and mxu is not None
    cycles = kernel_cost.between(bundles, fraction)
    busiest = kernel_cost.between(mxu, fraction)
    assert cycles is not None and busiest is not None
    loops = ", ".join(str(n) for n in trips)
    how = (
        f"loops whose trip counts read memory charged from the workload's lengths ({loops} "
        f"runs, outermost first), undecided regions run on {fraction:.0%} of their runs; "
        "every bundle by its executions"
    )
    if busiest > cycles:
        how += f"; MXU-bound: the busiest MXU needs {busiest} cycles for {cycles} bundles"
        cycles = busiest
    steps = schedule.grid_steps or schedule.trip_count or 1
    dma_bytes = _dma_bytes(found, occupancy, schedule.grid, fraction)
    return _entry(schedule, steps, cycles, how, found, dma_bytes, fraction)
