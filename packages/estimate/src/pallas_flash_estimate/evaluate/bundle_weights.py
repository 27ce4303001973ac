"""Per-bundle weights of a listing, as prefix sums: the cycles each MXU's instructions keep
it busy, and the bundles (or their weight) a set of spans covers. A loop's evaluation
(`bundle_listing.Loop.context`) weighs them by how often each bundle runs
(`cost.llo.executed_weight`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from pallas_flash_estimate.read.bundles import Bundle, Instruction

__all__ = ["MXU_ROWS_PER_CYCLE", "covered", "mxu_prefixes", "prefix_sums", "unit_prefixes"]


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


MXU_ROWS_PER_CYCLE = 1
"""Rows of the left operand one MXU takes per cycle (128 x 128 multiply-adds): a ``vmatmul``
of a bfloat16 vreg (16 packed rows) keeps its MXU busy 16 cycles, of a float32 vreg 8. This is
what 197 TFLOP/s at 1.5 GHz over 4 MXUs of 128 x 128 implies."""


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


def mxu_prefixes(bundles: tuple[Bundle, ...]) -> dict[str, list[int]]:
    """Per MXU: prefix sums of the cycles its ``vmatmul``s keep it busy."""
    return unit_prefixes(
        bundles, "vmatmul", lambda ins: (16 if ".bf16" in ins.opcode else 8) // MXU_ROWS_PER_CYCLE
    )
