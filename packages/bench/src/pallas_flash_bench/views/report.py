"""Markdown report of a benchmark run: ``report.md`` from the results dict of ``results.json``.

Every figure carries the tag of where it came from (``static``, ``model``, ``compiler``,
``measured-cpu``, ``measured-tpu``); missing values read as ``—``. The cells are formatted by
`cells`; the spread of estimates and the comparison with jax's kernels are `comparison`'s, the
kernels' schedules and the copies around them `compiled_report`'s.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from pallas_flash_bench.views import calibration_report
from pallas_flash_bench.views.cells import (
    MISSING,
    OPS,
    byte_size,
    figure,
    finite_number,
    first_line,
    integer,
    label,
    markdown_table,
    ms,
    num,
    op_then_sort_key,
    percent,
    shape,
    si,
    sort_key,
    subject,
    tagged,
    workload_of,
)
from pallas_flash_bench.views.comparison import against_references_table, mfu_range, spread_table
from pallas_flash_bench.views.compiled_report import copies_section, kernels_table
from pallas_flash_bench.views.context_report import context_section
from pallas_flash_bench.views.model_report import model_sections

OP_TITLES = {
    "forward": "Forward",
    "forward_backward": "Forward + backward",
    "decode": "Decode",
    "ragged": "Mixed serving steps (ragged attention)",
}

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


# --- the results tables -------------------------------------------------------------------------


def _compiled(row: Mapping[str, Any]) -> str:
    compiled = row.get("compiled")
    if compiled is None:
        return MISSING
    if compiled and not row.get("error"):
        return "✓"
    excerpt = first_line(row.get("error") or "")
    return f"✗ {excerpt}" if excerpt else "✗"


def _copy_bytes(row: Mapping[str, Any]) -> str:
    """Summed bytes of the copy trap; ``none`` when zero, ``—`` when not compiled."""
    copies = row.get("copies")
    if not row.get("compiled") or copies is None:
        return MISSING
    total = sum(finite_number(copy.get("bytes")) or 0 for copy in copies)
    return byte_size(total) if total else "none"


def _static_cycles(row: Mapping[str, Any]) -> str:
    """The whole program's static cycles (kernels and XLA ops), else the kernels' sum."""
    program = finite_number(row.get("static_cycles"))
    if program is not None:
        return num(program)
    cycles = [finite_number(k.get("cycles")) for k in row.get("kernels") or []]
    known = [c for c in cycles if c is not None]
    return num(sum(known)) if known else MISSING


def _hbm(row: Mapping[str, Any]) -> tuple[str, str]:
    hbm = row.get("hbm")
    if not isinstance(hbm, Mapping):
        return MISSING, MISSING
    total = finite_number(hbm.get("total"))
    gib = num(total / 1024**3) if total is not None else MISSING
    fits = hbm.get("fits")
    return gib, (MISSING if fits is None else ("✓" if fits else "✗"))


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
        label(row),
        subject(row),
        _compiled(row),
        gib,
        fits,
        _copy_bytes(row),
        _static_cycles(row),
        tagged(row, "latency_seconds", ms),
        tagged(row, "mfu", percent),
        mfu_range(row),
        tagged(row, "hbm_bandwidth_use", percent),
        tagged(row, "tokens_per_second", num),
        tagged(row, "tokens_per_dollar", num),
        tagged(row, "measured_seconds", ms),
    ]


def _results_tables(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["## Results", ""]
    if not rows:
        return [*lines, "No results.", ""]
    present = {str(workload_of(r).get("op")) for r in rows}
    ops = [op for op in OPS if op in present] + sorted(present - set(OPS))
    for op in ops:
        op_rows = sorted((r for r in rows if str(workload_of(r).get("op")) == op), key=sort_key)
        lines += [f"### {OP_TITLES.get(op, op)}", ""]
        shapes = sorted({shape(workload_of(r)) for r in op_rows})
        lines += [f"Shape{'s' if len(shapes) > 1 else ''}: " + "; ".join(shapes) + ".", ""]
        lines += markdown_table(RESULT_HEADER, (_result_row(r) for r in op_rows))
        lines.append("")
    return lines


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
        f"- Peak compute: {si(target.get('peak_flops'), 'FLOP/s')} per chip",
        f"- HBM: {byte_size(target.get('hbm_bytes'))} at {si(target.get('hbm_bandwidth'), 'B/s')}"
        " per chip",
        f"- Clock: {si(target.get('clock_hz'), 'Hz')}",
    ]
    if target.get("vmem_bytes") is not None:
        lines.append(f"- VMEM: {byte_size(target.get('vmem_bytes'))}")
    peak, bandwidth = (
        finite_number(target.get("peak_flops")),
        finite_number(target.get("hbm_bandwidth")),
    )
    if peak and bandwidth:
        lines.append(f"- Ridge point: {num(peak / bandwidth)} FLOP/byte")
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


def _decoding_table(results: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each backend's decode rows: latency against the HBM time, the collectives' share, the
    speed-up of several chips over one (their ``chip_scaling`` records), tokens/s and tokens
    per dollar."""
    decode = sorted(
        (r for r in rows if r.get("chip_scaling")),
        key=lambda r: (sort_key(r), workload_of(r).get("chips", 1)),
    )
    if not decode:
        return []
    target = (results.get("meta") or {}).get("target") or {}
    table = []
    for row in decode:
        scaling = row["chip_scaling"]
        collective = figure(row, "collective_seconds")[0]
        speedup = scaling.get("speedup_over_one_chip")
        table.append(
            [
                label(row),
                subject(row),
                tagged(row, "latency_seconds", ms),
                f"{scaling['latency_over_hbm_time']:.2f}x",
                f"{num(collective * 1e6)} us" if collective else "none",
                MISSING if speedup is None else f"{speedup:.2f}x",
                tagged(row, "tokens_per_second", num),
                tagged(row, "tokens_per_dollar", num),
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
    hop = finite_number(target.get("ici_hop_latency"))
    intro = (
        "One new token of one sequence. HBM time: the cache's bytes over the HBM bandwidth of "
        "the chips holding it, the roofline a decode step cannot beat. Several chips run the "
        "kernel on their share of the cache, then merge the partials with collectives, which "
        "are modelled, not scheduled (`pallas_flash_estimate.program.ici`): each costs an "
        f"assumed {num(wait * 1e6) + ' us' if wait is not None else MISSING} plus "
        f"{num(hop * 1e6) + ' us' if hop is not None else MISSING} per ring step and its ring "
        f"traffic over the slice's torus at {si(link, 'B/s')} per link and direction "
        "(`pallas_flash_estimate.targets`). Tokens per dollar pay for every chip the call uses."
    )
    return ["## Decoding one sequence", "", intro, "", *markdown_table(header, table), ""]


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
                integer(longest) if longest is not None else "none fits",
                integer(fit.get("limit_searched")),
                byte_size(fit.get("hbm_total_at_limit")),
                fit.get("source") or MISSING,
                fit.get("note") or "",
            ]
        )
    return [*lines, *markdown_table(header, table), ""]


def _notes_section(results: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> list[str]:
    meta_notes = [str(n) for n in (results.get("meta") or {}).get("notes") or []]
    row_notes = [
        f"{subject(row)}, {label(row)}: {note}"
        for row in sorted(rows, key=op_then_sort_key)
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
        *calibration_report.summary_section(results.get("calibration")),
        *against_references_table(rows),
        *_decoding_table(results, rows),
        *model_sections(results),
        *context_section(results),
        *_fits_table(list(results.get("fits") or [])),
        *kernels_table(rows),
        *copies_section(rows),
        *_notes_section(results, rows),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def write_report(results: Mapping[str, Any], path: pathlib.Path) -> None:
    """Write ``render_report(results)`` to ``path`` (UTF-8), creating its folder."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(results), encoding="utf-8")
