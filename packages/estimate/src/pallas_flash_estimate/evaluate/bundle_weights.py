"""Per-bundle weights of a listing, as prefix sums: the cycles each MXU's instructions keep
it busy, and the bundles (or their weight) a set of spans covers. A loop's evaluation
(`bundle_listing.Loop.context`) weighs them by how often each bundle runs
(`cost.llo.executed_weight`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from pallas_flash_estimate.read.bundles import Bundle, Instruction

__all__ = ["covered", "mxu_cycles", "mxu_prefixes", "prefix_sums", "unit_prefixes"]


def covered(spans: Iterable[tuple[int, int]], prefix: list[int] | None = None) -> int:
    """Bundles covered by a union of inclusive spans, or with ``prefix`` (``prefix[i]``: the
    summed weight of bundles ``0..i-1``) their summed weight."""
    total, reach = 0, -1
    for s, e in sorted(spans):
        if e <= reach:
            continue
        first = max(s, reach + 1)
        total += e - first + 1 if prefix is None else prefix[e + 1] - prefix[first]
        reach = e
    return total


def mxu_cycles(opcode: str, rows_per_cycle: int = 1) -> int:
    """Cycles a ``vmatmul`` keeps its MXU busy: a bfloat16 vreg holds 16 packed rows, a
    float32 vreg 8, and an MXU takes ``rows_per_cycle`` rows of the left operand a cycle
    (`targets.Target.mxu_rows_per_cycle`: one on 128-wide MXUs, two on v6e's 256-wide ones)."""
    return (16 if ".bf16" in opcode else 8) // rows_per_cycle


def unit_prefixes(
    bundles: tuple[Bundle, ...], family: str, cycles: Callable[[Instruction], int]
) -> dict[str, list[int]]:
    """Per MXU (``mxu0``..): prefix sums over the bundles of ``cycles`` of its instructions of
    the ``family`` (``vmatmul``, ``vmatpush``: every mnemonic starting so), the unit read from
    the mnemonic's last suffix."""
    units: dict[str, list[int]] = {}
    for b in bundles:
        for ins in b.instructions:
            if ins.base.startswith(family):
                unit = ins.opcode.rsplit(".", 1)[-1]
                units.setdefault(unit, [0] * len(bundles))[b.index] += cycles(ins)
    return {unit: prefix_sums(weights) for unit, weights in units.items()}


def prefix_sums(weights: Sequence[int]) -> list[int]:
    """``[0, w0, w0 + w1, ...]``: the form `llo.executed_weight` takes per-bundle weights in."""
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    return prefix


def mxu_prefixes(bundles: tuple[Bundle, ...], rows_per_cycle: int = 1) -> dict[str, list[int]]:
    """Per MXU: prefix sums of the cycles its ``vmatmul``s keep it busy (`mxu_cycles`)."""
    return unit_prefixes(bundles, "vmatmul", lambda ins: mxu_cycles(ins.opcode, rows_per_cycle))
