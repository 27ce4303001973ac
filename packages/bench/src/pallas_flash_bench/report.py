"""Markdown report of a benchmark run: ``report.md`` from the results dict of ``results.json``.

Every figure carries the tag of where it came from (``static``, ``model``, ``compiler``,
``measured-cpu``, ``measured-tpu``); missing values read as ``—``.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pallas_flash_bench.workloads import Workload

MISSING = "—"
OPS = ("forward", "forward_backward", "decode")
OP_TITLES = {
    "forward": "Forward",
    "forward_backward": "Forward + backward",
    "decode": "Decode",
}
UTILIZATION_UNITS = ("MXU", "VALU", "EUP", "VLOAD", "VSTORE")
NO_COPIES = "No copy, transpose or pad around the kernels"
ERROR_EXCERPT_CHARS = 60
ESTIMATE_TITLES = {
    "schedule": "Schedule (bundles)",
    "mxu": "MXU floor (matmuls)",
    "critical_path": "Critical path",
    "push8": "Pushes at 8, no overlap",
    "push16": "Pushes at 16, no overlap",
    "dma": "DMA bound",
}
"""The program estimates of a row (``runner.SPREAD``), as the report names them."""

HOW_TO_READ = (
    "Every figure is tagged with its source. "
    "`static`: from the TPU compiler's VLIW schedule: the bundles each grid step executes or "
    "the busiest MXU's matmul cycles, whichever is more, over the clock. It is an estimate, not "
    "a measurement: it ignores DMA stalls and charges weight pushes nothing, so its latency is "
    "rather a lower bound and the utilisation derived from it an upper bound; the MFU range and "
    "the section on how sure the estimates are give the same program under the other "
    "estimates (docs/benchmarks.md says what each ignores). "
    "`model`: roofline arithmetic (useful flops / peak FLOP/s, HBM bytes / HBM bandwidth). "
    "`compiler`: the compiler's memory and cost analysis (HBM footprint, bytes accessed). "
    "`measured-cpu` / `measured-tpu`: wall clock on that device; CPU timings only show that "
    "the code runs and say nothing about TPU speed. "
    "The copy trap is any copy, transpose or pad XLA places around a kernel: HBM traffic the "
    "kernel's own figures do not show."
)


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


def _num(value: Any) -> str:
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


def _int(value: Any) -> str:
    """Integer with thousands separators, or ``—``."""
    number = finite_number(value)
    if number is None:
        return MISSING
    return f"{int(number):,}" if number == int(number) else _num(number)


def _percent(fraction: Any) -> str:
    """A fraction as a percentage: ``0.612`` -> ``61.2 %``."""
    number = finite_number(fraction)
    if number is None:
        return MISSING
    percent = number * 100
    if percent != 0 and abs(percent) < 0.1:
        return f"{percent:.2g} %"
    return f"{percent:.1f} %"


def _si(value: Any, unit: str) -> str:
    """Decimal-prefixed quantity: ``1.97e14, "FLOP/s"`` -> ``197 TFLOP/s``."""
    number = finite_number(value)
    if number is None:
        return MISSING
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= factor:
            return f"{_num(number / factor)} {prefix}{unit}"
    return f"{_num(number)} {unit}"


def _bytes(value: Any) -> str:
    """Binary-prefixed byte count: ``33554432`` -> ``32 MiB``."""
    number = finite_number(value)
    if number is None:
        return MISSING
    for power, prefix in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if abs(number) >= 1024**power:
            return f"{_num(number / 1024**power)} {prefix}"
    return f"{int(number)} B"


def _cell(text: Any) -> str:
    """Text safe inside a Markdown table cell: one line, pipes escaped."""
    flat = " ".join(str(text).split())
    return flat.replace("|", "\\|") if flat else MISSING


def _excerpt(text: str, limit: int = ERROR_EXCERPT_CHARS) -> str:
    """First non-empty line of ``text``, cut to ``limit`` characters."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    first = " ".join(lines[0].split()) if lines else ""
    return first if len(first) <= limit else first[: limit - 1].rstrip() + "…"


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """Markdown table lines; every cell goes through ``_cell``."""
    lines = [
        "| " + " | ".join(_cell(h) for h in header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines.extend("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows)
    return lines


# --- reading the results ------------------------------------------------------------------------


def _figure(row: Mapping[str, Any], name: str) -> tuple[float | None, str | None]:
    """``(value, source)`` of one of a row's figures; ``(None, None)`` when absent."""
    figure = (row.get("figures") or {}).get(name)
    if not isinstance(figure, Mapping):
        return None, None
    return finite_number(figure.get("value")), figure.get("source")


def _tagged(row: Mapping[str, Any], name: str, render: Any) -> str:
    """A figure rendered with its source tag: ``1.23 ms (static)``."""
    value, source = _figure(row, name)
    if value is None:
        return MISSING
    return f"{render(value)} ({source})" if source else render(value)


def _ms(seconds: float) -> str:
    return f"{_num(seconds * 1e3)} ms"


def _workload(row: Mapping[str, Any]) -> Mapping[str, Any]:
    return row.get("workload") or {}


def _label(row: Mapping[str, Any]) -> str:
    """The row's workload label, built from the workload when the row has none."""
    if row.get("label"):
        return str(row["label"])
    workload = _workload(row)
    mask = "causal" if workload.get("causal") else "full"
    return f"{workload.get('op', '?')} N={workload.get('seq_len', '?')} {mask}"


def _subject(row: Mapping[str, Any]) -> str:
    """Subject name with its config, and a mark for reference kernels."""
    text = str(row.get("subject") or "?")
    if row.get("config"):
        text += f" ({row['config']})"
    if row.get("kind") == "reference":
        text += " [reference]"
    return text


def _sort_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    workload = _workload(row)
    seq_len = finite_number(workload.get("seq_len"))
    return (
        seq_len is None,
        seq_len or 0,
        bool(workload.get("causal")),
        str(row.get("subject") or ""),
        str(row.get("config") or ""),
    )


def _shape(workload: Mapping[str, Any]) -> str:
    """Everything about a workload but op, length and mask: batch, heads, head dim, dtype."""
    return (
        f"batch {workload.get('batch', '?')}, {workload.get('q_heads', '?')} query heads / "
        f"{workload.get('kv_heads', '?')} kv heads, head dim {workload.get('head_dim', '?')}, "
        f"{workload.get('dtype', '?')}"
    )


def _compiled(row: Mapping[str, Any]) -> str:
    compiled = row.get("compiled")
    if compiled is None:
        return MISSING
    if compiled and not row.get("error"):
        return "✓"
    excerpt = _excerpt(row.get("error") or "")
    return f"✗ {excerpt}" if excerpt else "✗"


def _copy_bytes(row: Mapping[str, Any]) -> str:
    """Summed bytes of the copy trap; ``none`` when zero, ``—`` when not compiled."""
    copies = row.get("copies")
    if not row.get("compiled") or copies is None:
        return MISSING
    total = sum(finite_number(copy.get("bytes")) or 0 for copy in copies)
    return _bytes(total) if total else "none"


def _static_cycles(row: Mapping[str, Any]) -> str:
    """The whole program's static cycles (kernels and XLA ops), else the kernels' sum."""
    program = finite_number(row.get("static_cycles"))
    if program is not None:
        return _num(program)
    cycles = [finite_number(k.get("cycles")) for k in row.get("kernels") or []]
    known = [c for c in cycles if c is not None]
    return _num(sum(known)) if known else MISSING


def _hbm(row: Mapping[str, Any]) -> tuple[str, str]:
    hbm = row.get("hbm")
    if not isinstance(hbm, Mapping):
        return MISSING, MISSING
    total = finite_number(hbm.get("total"))
    gib = _num(total / 1024**3) if total is not None else MISSING
    fits = hbm.get("fits")
    return gib, (MISSING if fits is None else ("✓" if fits else "✗"))


# --- sections -----------------------------------------------------------------------------------


def _chips_text(chips: Any) -> str:
    """What the target's chip count means for the rows."""
    if not chips:
        return ""
    if chips == 1:
        return ", 1 chip"
    return (
        f", a slice of {chips} chips: a call runs on one of them unless its workload says "
        '"on N chips"; prices, MFU and bandwidth use count the chips a call runs on'
    )


def _header(results: Mapping[str, Any]) -> list[str]:
    meta = results.get("meta") or {}
    target = meta.get("target") or {}
    versions = meta.get("versions") or {}
    name = target.get("name") or "unknown target"
    lines = [f"# Pallas-Flash benchmark: {name}", ""]

    chips = target.get("chips")
    lines += [
        "## Target",
        "",
        f"- **{name}**" + _chips_text(chips),
        f"- Peak compute: {_si(target.get('peak_flops'), 'FLOP/s')} per chip",
        f"- HBM: {_bytes(target.get('hbm_bytes'))} at {_si(target.get('hbm_bandwidth'), 'B/s')}"
        " per chip",
        f"- Clock: {_si(target.get('clock_hz'), 'Hz')}",
    ]
    if target.get("vmem_bytes") is not None:
        lines.append(f"- VMEM: {_bytes(target.get('vmem_bytes'))}")
    peak, bandwidth = (
        finite_number(target.get("peak_flops")),
        finite_number(target.get("hbm_bandwidth")),
    )
    if peak and bandwidth:
        lines.append(f"- Ridge point: {_num(peak / bandwidth)} FLOP/byte")
    lines.append("")

    lines += ["## Run", ""]
    if versions:
        lines.append("- Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    lines.append(f"- Date: {meta.get('date') or MISSING}")
    lines.append(f"- Sweep: {meta.get('sweep') or MISSING}")
    price = finite_number(meta.get("price_per_chip_hour"))
    if price is None:
        lines.append(f"- Price: {MISSING}")
    else:
        source = meta.get("price_source")
        suffix = f" (source: {source})" if source else ""
        lines.append(f"- Price: ${price:.2f} per chip-hour{suffix}")
    measured_on = meta.get("measured_on")
    if measured_on == "tpu":
        where = "wall-clock figures measured on a TPU"
    elif measured_on == "cpu":
        where = "wall-clock figures measured on CPU (they do not reflect TPU speed)"
    elif measured_on:
        where = f"wall-clock figures measured on {measured_on}"
    else:
        where = "nothing measured; every timing is an estimate"
    lines += [f"- Measurements: {where}", ""]

    lines += ["## How to read this", "", HOW_TO_READ, ""]
    return lines


RESULT_HEADER = (
    "Workload",
    "Subject",
    "Compiled",
    "HBM total (GiB)",
    "Fits HBM",
    "Copy trap",
    "Static cycles",
    "Est. latency",
    "MFU",
    "MFU range",
    "HBM BW use",
    "Tokens/s",
    "Tokens/$",
    "Measured",
)


def _result_row(row: Mapping[str, Any]) -> list[str]:
    gib, fits = _hbm(row)
    return [
        _label(row),
        _subject(row),
        _compiled(row),
        gib,
        fits,
        _copy_bytes(row),
        _static_cycles(row),
        _tagged(row, "latency_seconds", _ms),
        _tagged(row, "mfu", _percent),
        _mfu_range(row),
        _tagged(row, "hbm_bandwidth_use", _percent),
        _tagged(row, "tokens_per_second", _num),
        _tagged(row, "tokens_per_dollar", _num),
        _tagged(row, "measured_seconds", _ms),
    ]


def _estimate(row: Mapping[str, Any], name: str, key: str) -> float | None:
    """A row's figure ``key`` (``cycles``, ``latency_seconds``, ``mfu``) under one estimate."""
    return finite_number(((row.get("estimates") or {}).get(name) or {}).get(key))


RANGE_ESTIMATES = ("critical_path", "push8", "push16", "dma")
"""The estimates that are whole figures like the headline: the schedule alone and the MXU
floor alone are its two parts (each a bound on time only), left out of the MFU range."""


def _mfu_range(row: Mapping[str, Any]) -> str:
    """Least and most MFU over the headline and the whole estimates (`RANGE_ESTIMATES`):
    ``66.7 to 97.6 %``; ``—`` without them."""
    if not any(_estimate(row, name, "mfu") is not None for name in RANGE_ESTIMATES):
        return MISSING
    values = [_figure(row, "mfu")[0], *(_estimate(row, name, "mfu") for name in RANGE_ESTIMATES)]
    known = [v for v in values if v is not None]
    if not known:
        return MISSING
    return f"{100 * min(known):.1f} to {_percent(max(known))}"


SPREAD_HEADER = ("Workload", "Subject", "MFU (headline)", *ESTIMATE_TITLES.values())
"""Columns of `spread_table`."""


def spread_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each row's MFU under every estimate beside the headline figure."""
    with_spread = sorted((r for r in rows if r.get("estimates")), key=_op_then_sort_key)
    if not with_spread:
        return []
    header = SPREAD_HEADER
    table = [
        [
            _label(row),
            _subject(row),
            _tagged(row, "mfu", _percent),
            *(_percent(_estimate(row, name, "mfu")) for name in ESTIMATE_TITLES),
        ]
        for row in with_spread
    ]
    intro = (
        "The same compiled program under each static estimate (MFU; latency is compute or "
        "memory time, whichever is longer, as for the headline). Headline: the schedule's "
        "executed bundles or the busiest MXU's matmul cycles, whichever is more, weight pushes "
        "free. Schedule: executed bundles only, one per cycle. MXU floor: the busiest MXU's "
        "`vmatmul`s only (16 cycles per bf16 vreg). Critical path: the compiler's latency model "
        "per executed basic block, a bf16 weight push 8 cycles, overlapped with the previous "
        "tile's matmuls. Pushes at 8 / 16, no overlap: every `vmatpush` charged 8 / 16 cycles on "
        "its MXU on top of the matmuls (or the bundles, if more): how much a lead rests on "
        "pushes being hidden. DMA bound: per kernel the longer of its compute and its block "
        "copies at the HBM bandwidth (copies whose predicate the schedule cannot decide "
        "counted every step). No hardware measurement tells which is right."
    )
    return ["## How sure the estimates are", "", intro, "", *_table(header, table), ""]


def _results_tables(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["## Results", ""]
    if not rows:
        return [*lines, "No results.", ""]
    present = {str(_workload(r).get("op")) for r in rows}
    ops = [op for op in OPS if op in present] + sorted(present - set(OPS))
    for op in ops:
        op_rows = sorted((r for r in rows if str(_workload(r).get("op")) == op), key=_sort_key)
        lines += [f"### {OP_TITLES.get(op, op)}", ""]
        shapes = sorted({_shape(_workload(r)) for r in op_rows})
        lines += [f"Shape{'s' if len(shapes) > 1 else ''}: " + "; ".join(shapes) + ".", ""]
        lines += _table(RESULT_HEADER, (_result_row(r) for r in op_rows))
        lines.append("")
    return lines


AGAINST_REFERENCES_HEADER = (
    "Workload",
    "Backend",
    "Est. latency",
    "MFU",
    "Fastest jax kernel",
    "Its latency",
    "Its MFU",
    "Speed-up",
    "Speed-up, no overlap",
    "Lead under every estimate?",
)
"""Columns of `against_references_table`."""


def against_references_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each backend's row beside the fastest reference kernel of the same workload."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(json.dumps(_workload(row), sort_keys=True), []).append(row)
    table = []
    for group in groups.values():
        timed = [r for r in group if _figure(r, "latency_seconds")[0] is not None]
        references = [r for r in timed if r.get("kind") == "reference"]
        if not references:
            continue
        fastest = min(references, key=lambda r: _figure(r, "latency_seconds")[0])
        fastest_latency = _figure(fastest, "latency_seconds")[0]
        serial = [_figure(r, "latency_no_overlap_seconds")[0] for r in references]
        fastest_serial = min((t for t in serial if t is not None), default=None)
        for row in sorted((r for r in timed if r.get("kind") != "reference"), key=_sort_key):
            latency = _figure(row, "latency_seconds")[0]
            lead = _lead(row, references)
            row_serial = _figure(row, "latency_no_overlap_seconds")[0]
            table.append(
                [
                    _label(row),
                    _subject(row),
                    _tagged(row, "latency_seconds", _ms),
                    _tagged(row, "mfu", _percent),
                    _subject(fastest).removesuffix(" [reference]"),
                    _tagged(fastest, "latency_seconds", _ms),
                    _tagged(fastest, "mfu", _percent),
                    f"{fastest_latency / latency:.2f}x" if latency else MISSING,
                    f"{fastest_serial / row_serial:.2f}x"
                    if fastest_serial and row_serial
                    else MISSING,
                    lead,
                ]
            )
    if not table:
        return []
    header = AGAINST_REFERENCES_HEADER
    intro = (
        "Each backend against the fastest of jax's own kernels on the same workload, through "
        "the same analysis (speed-up: the jax kernel's estimated latency over the backend's). "
        "The estimate takes a kernel's HBM transfers and its compute to overlap fully; the last "
        "column takes them not to overlap at all (latency: compute + memory time, against the "
        "jax kernel with the least of it). A kernel that overlaps them in part lies between "
        "the two: memory-bound kernels tie in the first and differ by their compute in the "
        "second. The last column redoes the speed-up under each estimate of the section "
        "above, against the jax kernel fastest under that estimate: whether the lead (or the "
        "deficit) holds under all of them, or under which it turns."
    )
    return ["## Against jax's kernels", "", intro, "", *_table(header, table), ""]


ASSUMPTIONS = {
    "push8": "weight pushes hidden under the matmuls",
    "push16": "weight pushes hidden under the matmuls",
    "dma": "block copies hidden under the compute",
    "critical_path": "the schedule, not the compiler's latency model",
    "schedule": "the MXU floor, not the bundles",
    "mxu": "the bundles, not the MXU floor",
}
"""What a lead that turns under an estimate rests on."""


def _lead(row: Mapping[str, Any], references: Sequence[Mapping[str, Any]]) -> str:
    """Whether a backend's row beats the fastest reference under every estimate, or which
    estimates its lead rests on (speed-ups under the others)."""
    ahead, behind, turns = [], [], []
    for name, title in ESTIMATE_TITLES.items():
        mine = _estimate(row, name, "latency_seconds")
        theirs = [t for r in references if (t := _estimate(r, name, "latency_seconds"))]
        if not mine or not theirs:
            continue
        speedup = min(theirs) / mine
        (ahead if speedup >= 1 else behind).append(f"{title} {speedup:.2f}x")
        if speedup < 1 and ASSUMPTIONS[name] not in turns:
            turns.append(ASSUMPTIONS[name])
    if not ahead and not behind:
        return MISSING
    if not behind:
        return f"ahead under every estimate ({', '.join(ahead)})"
    if not ahead:
        return f"behind under every estimate ({', '.join(behind)})"
    return (
        f"the lead rests on {' and '.join(turns)}: ahead under {', '.join(ahead)}; "
        f"behind under {', '.join(behind)}"
    )


def _one_chip_twin(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> Any:
    """The same subject's row of the same workload on one chip, or None."""
    single = {**_workload(row), "chips": 1}
    for other in rows:
        same_subject = (other.get("subject"), other.get("config")) == (
            row.get("subject"),
            row.get("config"),
        )
        if same_subject and {"chips": 1, **_workload(other)} == single:
            return other
    return None


def _hbm_time(workload: Mapping[str, Any], bandwidth: float | None) -> float | None:
    """The least HBM time of a workload: the bytes it must move over the bandwidth of the
    chips it runs on; None when the workload or the bandwidth is not known."""
    try:
        least = Workload(**workload).min_hbm_bytes
    except (TypeError, ValueError):
        return None
    return least / bandwidth / int(workload.get("chips", 1)) if bandwidth else None


def _decoding_table(results: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each backend's decode rows: latency against the HBM time, the collectives' share, the
    speed-up of several chips over one, tokens/s and tokens per dollar."""
    decode = sorted(
        (
            r
            for r in rows
            if _workload(r).get("op") == "decode"
            and r.get("kind") != "reference"
            and _figure(r, "latency_seconds")[0] is not None
        ),
        key=lambda r: (_sort_key(r), _workload(r).get("chips", 1)),
    )
    if not decode:
        return []
    target = (results.get("meta") or {}).get("target") or {}
    bandwidth = finite_number(target.get("hbm_bandwidth"))
    table = []
    for row in decode:
        latency = _figure(row, "latency_seconds")[0]
        memory = _hbm_time(_workload(row), bandwidth)
        collective = _figure(row, "collective_seconds")[0]
        twin = _one_chip_twin(row, rows) if _workload(row).get("chips", 1) > 1 else None
        twin_latency = _figure(twin, "latency_seconds")[0] if twin else None
        table.append(
            [
                _label(row),
                _subject(row),
                _tagged(row, "latency_seconds", _ms),
                f"{latency / memory:.2f}x" if memory else MISSING,
                f"{_num(collective * 1e6)} us" if collective else "none",
                f"{twin_latency / latency:.2f}x" if twin_latency else MISSING,
                _tagged(row, "tokens_per_second", _num),
                _tagged(row, "tokens_per_dollar", _num),
            ]
        )
    header = [
        "Workload",
        "Backend",
        "Est. latency",
        "Latency / HBM time",
        "Collectives",
        "Speed-up over one chip",
        "Tokens/s",
        "Tokens/$",
    ]
    link, wait = target.get("ici_link_bandwidth"), finite_number(target.get("collective_latency"))
    intro = (
        "One new token of one sequence. HBM time: the cache's bytes over the HBM bandwidth of "
        "the chips holding it, the roofline a decode step cannot beat. Several chips run the "
        "kernel on their share of the cache, then merge the partials with collectives, which "
        "are modelled, not scheduled: each costs an assumed "
        f"{_num(wait * 1e6) + ' us' if wait is not None else MISSING} plus its ring traffic "
        "over one ICI link "
        f"at {_si(link, 'B/s')} (`pallas_flash_bench.targets`). Tokens per dollar pay for every "
        "chip the call uses."
    )
    return ["## Decoding one sequence", "", intro, "", *_table(header, table), ""]


def _fits_table(fits: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["## Longest sequence that fits", ""]
    if not fits:
        return [*lines, "No search was run.", ""]

    def key(fit: Mapping[str, Any]) -> tuple[int, str, str]:
        op = str(fit.get("op"))
        order = OPS.index(op) if op in OPS else len(OPS)
        return order, op, str(fit.get("subject"))

    header = (
        "Subject",
        "Op",
        "Longest seq_len",
        "Searched up to",
        "HBM at limit",
        "Source",
        "Note",
    )
    table = []
    for fit in sorted(fits, key=key):
        longest = fit.get("longest_seq_len")
        table.append(
            [
                fit.get("subject") or MISSING,
                fit.get("op") or MISSING,
                _int(longest) if longest is not None else "none fits",
                _int(fit.get("limit_searched")),
                _bytes(fit.get("hbm_total_at_limit")),
                fit.get("source") or MISSING,
                fit.get("note") or "",
            ]
        )
    return [*lines, *_table(header, table), ""]


def _grid(grid: Any) -> str:
    if not grid:
        return MISSING
    return "x".join(str(g) for g in grid)


def _per_step_us(total: Any, steps: Any, rate: float | None) -> str:
    """``total / steps / rate`` in microseconds (cycles over the clock, bytes over the HBM
    bandwidth), or ``—``."""
    total, steps = finite_number(total), finite_number(steps)
    if total is None or not steps or not rate:
        return MISSING
    return f"{_num(total / steps / rate * 1e6)} us"


def _kernels_table(rows: Sequence[Mapping[str, Any]], target: Mapping[str, Any]) -> list[str]:
    lines = ["## Kernel schedules", ""]
    with_kernels = sorted((r for r in rows if r.get("kernels")), key=_op_then_sort_key)
    if not with_kernels:
        return [*lines, "No kernel schedules were extracted.", ""]
    lines += [
        "From the compiler's VLIW bundles: utilisation is the share of bundles that keep the unit "
        "busy (static, an upper bound). Pushes: `vmatpush` instructions (weights loaded into an "
        "MXU) in the grid loop body, all MXUs. DMA/step: the bytes the kernel's block copies "
        "move per grid step (at most: copies whose predicate the schedule cannot decide counted "
        "every step) over the HBM bandwidth, against its compute per step (headline cycles): a "
        "kernel whose DMA/step exceeds its compute/step cannot hide its copies.",
        "",
    ]
    header = (
        "Subject",
        "Workload",
        "Kernel",
        "Bundles/step",
        "Steps",
        "Grid",
        "Predicated bundles",
        *(f"{unit} %" for unit in UTILIZATION_UNITS),
        "Spills (stores/fills)",
        "MXU ops",
        "Pushes",
        "VMEM",
        "Cycles",
        "Compute/step",
        "DMA/step",
    )
    clock = finite_number(target.get("clock_hz"))
    bandwidth = finite_number(target.get("hbm_bandwidth"))
    table = []
    for row in with_kernels:
        for kernel in row["kernels"]:
            utilization = kernel.get("utilization") or {}
            spills = f"{_int(kernel.get('spill_stores'))} / {_int(kernel.get('fill_loads'))}"
            table.append(
                [
                    _subject(row),
                    _label(row),
                    kernel.get("name") or MISSING,
                    _int(kernel.get("bundles_per_step")),
                    _int(kernel.get("steps")),
                    _grid(kernel.get("grid")),
                    _int(kernel.get("predicated_bundles")),
                    *(_percent(utilization.get(unit)) for unit in UTILIZATION_UNITS),
                    spills,
                    _int(kernel.get("mxu_ops")),
                    _int(kernel.get("pushes")),
                    _bytes(kernel.get("vmem_bytes")),
                    _num(kernel.get("cycles")),
                    _per_step_us(kernel.get("cycles"), kernel.get("steps"), clock),
                    _per_step_us(kernel.get("dma_bytes"), kernel.get("steps"), bandwidth),
                ]
            )
    return [*lines, *_table(header, table), ""]


def _op_then_sort_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    op = str(_workload(row).get("op"))
    return (OPS.index(op) if op in OPS else len(OPS), op, *_sort_key(row))


def _copies_section(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["## Copy trap", ""]
    compiled = sorted((r for r in rows if r.get("compiled")), key=_op_then_sort_key)
    with_copies = [r for r in compiled if r.get("copies")]
    if not compiled:
        return [*lines, "Nothing compiled.", ""]
    if not with_copies:
        return [*lines, f"{NO_COPIES}.", ""]
    header = ("Subject", "Workload", "Name", "Opcode", "Shape", "Bytes", "Detail")
    table = [
        [
            _subject(row),
            _label(row),
            copy.get("name") or MISSING,
            copy.get("opcode") or MISSING,
            copy.get("shape") or MISSING,
            _bytes(copy.get("bytes")),
            copy.get("detail") or "",
        ]
        for row in with_copies
        for copy in row["copies"]
    ]
    lines += [*_table(header, table), ""]
    clean = len(compiled) - len(with_copies)
    if clean:
        lines += [f"{NO_COPIES} in the other {clean} compiled row{'s' if clean > 1 else ''}.", ""]
    return lines


def _notes_section(results: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> list[str]:
    meta_notes = [str(n) for n in (results.get("meta") or {}).get("notes") or []]
    row_notes = [
        f"{_subject(row)}, {_label(row)}: {note}"
        for row in sorted(rows, key=_op_then_sort_key)
        for note in row.get("notes") or []
    ]
    if not meta_notes and not row_notes:
        return []
    lines = ["## Notes", ""]
    lines += [f"- {' '.join(note.split())}" for note in meta_notes + row_notes]
    return [*lines, ""]


# --- public -------------------------------------------------------------------------------------


def render_report(results: Mapping[str, Any]) -> str:
    """The Markdown report of a results dict (the contents of ``results.json``)."""
    rows = list(results.get("rows") or [])
    lines = [
        *_header(results),
        *_results_tables(rows),
        *spread_table(rows),
        *against_references_table(rows),
        *_decoding_table(results, rows),
        *_fits_table(list(results.get("fits") or [])),
        *_kernels_table(rows, (results.get("meta") or {}).get("target") or {}),
        *_copies_section(rows),
        *_notes_section(results, rows),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def write_report(results: Mapping[str, Any], path: pathlib.Path) -> None:
    """Write ``render_report(results)`` to ``path`` (UTF-8), creating its folder."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(results), encoding="utf-8")
