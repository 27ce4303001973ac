"""The cells of the report's Markdown tables: numbers, sizes and percentages formatted, and a
results row's figures (each with its source tag) and labels read; missing values read as ``—``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

MISSING = "—"
OPS = ("forward", "forward_backward", "decode", "ragged")
ERROR_EXCERPT_CHARS = 60


# --- formatting -------------------------------------------------------------------------------


def finite_number(value: Any) -> float | None:
    """``value`` as a float, or None when it is missing, not a number or not finite."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def num(value: Any) -> str:
    """Compact number: ``1.23``, ``12.3``, ``123``, ``3.4e6``, ``2.5e-5``; ``—`` when missing."""
    number = finite_number(value)
    if number is None:
        return MISSING
    if number == 0:
        return "0"
    magnitude = abs(number)
    if magnitude >= 1e5 or magnitude < 1e-3:
        mantissa, exponent = f"{number:.2e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exponent)}"
    if magnitude >= 100:
        return f"{number:.0f}"
    return f"{number:.3g}"


def integer(value: Any) -> str:
    """Integer with thousands separators, or ``—``."""
    number = finite_number(value)
    if number is None:
        return MISSING
    return f"{int(number):,}" if number == int(number) else num(number)


def percent(fraction: Any) -> str:
    """A fraction as a percentage: ``0.612`` -> ``61.2 %``."""
    number = finite_number(fraction)
    if number is None:
        return MISSING
    scaled = number * 100
    if scaled != 0 and abs(scaled) < 0.1:
        return f"{scaled:.2g} %"
    return f"{scaled:.1f} %"


def si(value: Any, unit: str) -> str:
    """Decimal-prefixed quantity: ``1.97e14, "FLOP/s"`` -> ``197 TFLOP/s``."""
    number = finite_number(value)
    if number is None:
        return MISSING
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= factor:
            return f"{num(number / factor)} {prefix}{unit}"
    return f"{num(number)} {unit}"


def byte_size(value: Any) -> str:
    """Binary-prefixed byte count: ``33554432`` -> ``32 MiB``."""
    number = finite_number(value)
    if number is None:
        return MISSING
    for power, prefix in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if abs(number) >= 1024**power:
            return f"{num(number / 1024**power)} {prefix}"
    return f"{int(number)} B"


def ms(seconds: float) -> str:
    """Seconds as milliseconds: ``0.00123`` -> ``1.23 ms``."""
    return f"{num(seconds * 1e3)} ms"


def cell(text: Any) -> str:
    """Text safe inside a Markdown table cell: one line, pipes escaped."""
    flat = " ".join(str(text).split())
    return flat.replace("|", "\\|") if flat else MISSING


def first_line(text: str, limit: int = ERROR_EXCERPT_CHARS) -> str:
    """First non-empty line of ``text``, cut to ``limit`` characters."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    first = " ".join(lines[0].split()) if lines else ""
    return first if len(first) <= limit else first[: limit - 1].rstrip() + "…"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """Markdown table lines; every cell goes through `cell`."""
    lines = [
        "| " + " | ".join(cell(h) for h in header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines.extend("| " + " | ".join(cell(c) for c in row) + " |" for row in rows)
    return lines


# --- reading the results ------------------------------------------------------------------------


def figure(row: Mapping[str, Any], name: str) -> tuple[float | None, str | None]:
    """``(value, source)`` of one of a row's figures; ``(None, None)`` when absent."""
    entry = (row.get("figures") or {}).get(name)
    if not isinstance(entry, Mapping):
        return None, None
    return finite_number(entry.get("value")), entry.get("source")


def tagged(row: Mapping[str, Any], name: str, render: Any) -> str:
    """A figure rendered with its source tag: ``1.23 ms (static)``."""
    value, source = figure(row, name)
    if value is None:
        return MISSING
    return f"{render(value)} ({source})" if source else render(value)


def workload_of(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """The row's workload dict, empty when it has none."""
    return row.get("workload") or {}


def label(row: Mapping[str, Any]) -> str:
    """The row's workload label, built from the workload when the row has none."""
    if row.get("label"):
        return str(row["label"])
    workload = workload_of(row)
    mask = "causal" if workload.get("causal") else "full"
    return f"{workload.get('op', '?')} N={workload.get('seq_len', '?')} {mask}"


def subject(row: Mapping[str, Any]) -> str:
    """Subject name with its config, and a mark for reference kernels."""
    text = str(row.get("subject") or "?")
    if row.get("config"):
        text += f" ({row['config']})"
    if row.get("kind") == "reference":
        text += " [reference]"
    return text


def sort_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """Rows in table order: by sequence length (unknown last), mask, subject and config."""
    workload = workload_of(row)
    seq_len = finite_number(workload.get("seq_len"))
    return (
        seq_len is None,
        seq_len or 0,
        bool(workload.get("causal")),
        str(row.get("subject") or ""),
        str(row.get("config") or ""),
    )


def op_then_sort_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """Rows grouped by op (in `OPS` order, unknown ops last), then in `sort_key` order."""
    op = str(workload_of(row).get("op"))
    return (OPS.index(op) if op in OPS else len(OPS), op, *sort_key(row))


def shape(workload: Mapping[str, Any]) -> str:
    """Everything about a workload but op, length and mask: batch, heads, head dim, dtype."""
    return (
        f"batch {workload.get('batch', '?')}, {workload.get('q_heads', '?')} query heads / "
        f"{workload.get('kv_heads', '?')} kv heads, head dim {workload.get('head_dim', '?')}, "
        f"{workload.get('dtype', '?')}"
    )
