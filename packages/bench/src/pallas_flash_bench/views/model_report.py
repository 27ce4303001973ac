"""The report's model sections: training steps against MaxText, serving against JetStream,
the ablation, and what each step's estimate is made of.

Ours are static estimates from a v5e compile on a CPU host (`whole_program`, `ici`); the
references were measured on TPUs by their authors. Every time is given as the compiled
schedule overlaps the collectives, then both ends: ``scheduled (hidden .. exposed)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pallas_flash_bench.models import model_figures
from pallas_flash_bench.views.cells import MISSING, byte_size, markdown_table, num, percent


def ends_cell(values: Mapping[str, Any] | None, render: Callable[[Any], str]) -> str:
    """``s (a .. b)`` of a figure as the schedule overlaps the collectives and copies, all
    hidden and none hidden (``a .. b`` without the schedule's; one value when they agree)."""
    if not values or values.get("overlapped") is None:
        return MISSING
    lo, hi = render(values["overlapped"]), render(values["exposed"])
    ends = lo if lo == hi else f"{lo} .. {hi}"
    if values.get("scheduled") is None:
        return ends
    scheduled = render(values["scheduled"])
    return scheduled if scheduled == ends else f"{scheduled} ({ends})"


def pessimistic_cell(values: Mapping[str, Any] | None, render: Callable[[Any], str]) -> str:
    """``exposed (as scheduled s; all hidden h)``: a figure at its pessimistic end first, the
    end no overlap assumption can move, until a measurement calibrates the overlap."""
    if not values or values.get("exposed") is None:
        return MISSING
    exposed = render(values["exposed"])
    others = [f"{name} {render(values[end])}" for end, name in
              (("scheduled", "as scheduled"), ("overlapped", "all hidden"))
              if values.get(end) is not None and render(values[end]) != exposed]  # fmt: skip
    return f"{exposed} ({'; '.join(others)})" if others else exposed


OVERLAP_NOTE = (
    "Each time (and the figures from it): first with nothing hidden (collectives and the "
    "asynchronous copies, weights prefetched into VMEM, serial with the compute: no "
    "measurement here calibrates their overlap), then in brackets as the compiled schedule "
    "overlaps them (the schedule replayed: a collective runs between its start and its done, "
    "one at a time on the links; a copy on the HBM time the ops between leave unused) and "
    "with all of them hidden. The references' figures were measured on TPUs by their authors "
    "(calibration points for an estimator, not figures an estimate can beat)."
)


def seconds_cell(value: Any) -> str:
    """A time in seconds, ``1.23 s``."""
    return f"{num(value)} s"


def _ms(value: Any) -> str:
    return f"{num(value * 1e3)} ms"


def peak_hbm_cell(row: Mapping[str, Any]) -> str:
    """A row's peak HBM a chip and its share of the chip's, or what it needed when it does
    not fit (from ``row["figures"]``: ``peak_hbm``, ``fits``)."""
    f = row.get("figures") or {}
    peak = f.get("peak_hbm")
    if peak is None:
        return MISSING
    if not f.get("fits"):
        return f"does not fit: needs {byte_size(peak)} of temporaries"
    return f"{byte_size(peak)} ({percent(f.get('peak_hbm_share'))})"


def _split(w: Mapping[str, Any]) -> str:
    """What a serving row's cache is split over: ``kv heads`` or ``sequence``."""
    return "kv heads" if w.get("cache_split", "heads") == "heads" else "sequence"


def _slice(w: Mapping[str, Any]) -> str:
    data, fsdp, tensor = w["mesh"]
    return f"{w['target']} (data {data}, fsdp {fsdp}, tensor {tensor})"


def _reference(row: Mapping[str, Any], render: Callable[[Any], str]) -> tuple[str, str]:
    f = row.get("figures") or {}
    ref = f.get("reference")
    if ref is None:
        return "none published", MISSING
    ratio = pessimistic_cell(f.get("against_reference"), lambda x: f"{num(x)}x")
    return f"{render(ref['value'])} ({ref['source']})", ratio


def _program_ratio(figures: Mapping[str, Any], key: str,
                   render: Callable[[Any], str]) -> tuple[str, str]:  # fmt: skip
    """The reference program's ``key`` (``figures["reference_program"]``, the same estimator)
    and ours against it at each end with its verdict (``against_reference_program``:
    `model_figures.against_reference_program`)."""
    program = figures.get("reference_program")
    found = (figures.get("against_reference_program") or {}).get(key)
    if program is None or key not in program or found is None:
        return MISSING, MISSING
    cell = pessimistic_cell(found["ratio"], lambda x: f"{num(x)}x")
    if found["verdict"] is not None:
        cell += f": {found['verdict']} (band ±{percent(found['band'])})"
    return pessimistic_cell(program[key], render), cell


def _failed(row: Mapping[str, Any]) -> str | None:
    if row.get("error"):
        return f"not analysed: {row['error'][:120]}"
    return None


def training_table(models: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = []
    for row in models:
        w = row["workload"]
        if w["step"] != "train" or w["name"].startswith("ablation"):
            continue
        f = row.get("figures") or {}
        ref, _ = _reference(row, percent)
        failed = _failed(row)
        theirs, _ = _program_ratio(f, "mfu", percent)
        _, ratio = _program_ratio(f, "step_seconds", seconds_cell)  # our speed-up
        rows.append([w["name"], _slice(w), f"{w['batch']} x {w['seq_len']}", w["remat"],
                     failed or pessimistic_cell(f.get("step_seconds"), seconds_cell),
                     pessimistic_cell(f.get("mfu"), percent),
                     pessimistic_cell(f.get("tokens_per_chip_second"), num), peak_hbm_cell(row),
                     theirs, ratio, ref])  # fmt: skip
    if not rows:
        return []
    header = ["workload", "slice", "batch x seq", "remat", "step (static)", "MFU (static)",
              "tokens/s/chip", "peak HBM per chip", "MaxText's own step, same estimator: MFU",
              "speed-up over MaxText's step",
              "published MFU (measured: a calibration point)"]  # fmt: skip
    intro = (
        "MaxText's own step: its train step for the same configuration, compiled by "
        "MaxText's AOT path for the same slice and estimated by the same estimator, "
        "libtpu and analysis (`maxtext_steps`); MFU by one flop count for both (MaxText's "
        "current one, causal attention halved). The published MFU was measured on TPUs "
        "by MaxText's authors with its flop count of the time (attention not halved): "
        "the calibration holds MaxText's estimated step against it (docs/calibration.md)."
    )
    return ["## Training steps against MaxText (v5e)", "", intro, "", OVERLAP_NOTE, "",
            *markdown_table(header, rows), ""]  # fmt: skip


def serving_table(models: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = []
    for row in models:
        w = row["workload"]
        if w["step"] != "serve":
            continue
        f = row.get("figures") or {}
        ref, ratio = _reference(row, lambda v: f"{num(v)} tok/s")
        theirs, over = _program_ratio(f, "tokens_per_second", num)
        rows.append([w["name"], _slice(w), w["batch"], f"{w['prompt_len']} / {w['generate_len']}",
                     f"{w.get('kv_dtype') or 'bfloat16'}, split over {_split(w)}",
                     _failed(row) or pessimistic_cell(f.get("prefill_seconds"), seconds_cell),
                     pessimistic_cell(f.get("decode_step_seconds"), _ms),
                     pessimistic_cell(f.get("tokens_per_second"), num),
                     pessimistic_cell(f.get("tokens_per_dollar"), num), peak_hbm_cell(row),
                     theirs, over, ref, ratio])  # fmt: skip
    if not rows:
        return []
    header = ["workload", "slice", "batch", "prompt / generated", "KV cache", "prefill",
              "decode step (mean)", "tokens/s (static)", "tokens/$", "peak HBM per chip",
              "MaxText's engine, same estimator: tokens/s", "ours / MaxText's engine",
              "reference (measured: a calibration point)", "ours / measured"]  # fmt: skip
    return ["## Serving against JetStream (v5e)", "",
            "Tokens/s: every generated token over the prefill (`prefill_batch` prompts a "
            "step, each step's caches then inserted into the decode batch's, the batch's steps "
            "together) plus all decode steps with their greedy sampling, each charged as the "
            "run's average step: "
            "a batch whose lengths spread evenly over every length the run reaches (prompt + 1 "
            "to prompt + generated), its kernels charged the blocks or 128-position pages they "
            "copy, its flops at the mean length. A cache split over kv heads: each chip "
            "decodes its heads of every sequence, nothing exchanged. Split along the sequence: "
            "each chip holds a "
            "share of every sequence's positions and the partials are merged across chips; "
            "the first chip's share is full from the first step, so its every block is "
            f"charged. {OVERLAP_NOTE}", "",
            *markdown_table(header, rows), ""]  # fmt: skip


def engine_table(models: Sequence[Mapping[str, Any]]) -> list[str]:
    """The serving engine's steps (``step == "engine"``): each step's latency, MFU and
    tokens/s, against MaxText's engine (the same estimator) and a measurement."""
    engine = [row for row in models if row["workload"]["step"] == "engine"]
    if not engine:
        return []
    from pallas_flash_bench.kernels import ragged_step
    from pallas_flash_bench.models.model_workloads import ModelWorkload  # the LLaMa package

    rows = []
    for row in engine:
        w = ModelWorkload(**row["workload"])
        f = row.get("figures") or {}
        ref, _ = _reference(row, lambda v: f"{num(v)} tok/s")
        theirs, over = _program_ratio(f, "tokens_per_second", num)
        run = "vLLM's step" if w.mix else f"steady state, {w.prompt_len} / {w.generate_len}"
        if w.cached_prefix:
            run += f", the first {w.cached_prefix} cached"
        cal = f.get("calibrated") or {}
        calibrated = MISSING if not cal else num(cal["tokens_per_second"])
        if cal and cal.get("band") is not None:
            calibrated += f" ±{percent(cal['band'])}"
        rows.append([w.name, _slice(w.to_json()), f"{run}: {ragged_step.label(w.engine_mix())}",
                     f"{w.engine_bucket} of {w.token_budget}",
                     _failed(row) or pessimistic_cell(f.get("step_seconds"), _ms),
                     pessimistic_cell(f.get("mfu"), percent),
                     pessimistic_cell(f.get("tokens_per_second"), num), calibrated,
                     pessimistic_cell(f.get("tokens_per_dollar"), num), peak_hbm_cell(row),
                     _sampling_cell(f.get("step_seconds_by_sampling")), theirs, over,
                     ref])  # fmt: skip
    header = ["workload", "slice", "step (all heads)", "tokens compiled (bucket of budget)",
              "step (static)", "MFU (static)", "tokens/s (static)", "tokens/s (calibrated)",
              "tokens/$", "peak HBM per chip",
              "step as scheduled (static) if every slot samples: greedy; top-k/top-p in its 256 "
              "candidates (the row's); past them, the vocabulary sorted",
              "MaxText's engine, same estimator: tokens/s",
              "ours / MaxText's engine",
              "published measurement of the run (a calibration point, not compared)"]  # fmt: skip
    return ["## The serving engine's steps (v5e-8)", "",
            "One step of `pallas-flash-llama`'s serving engine, compiled whole for v5e-8: the "
            "model tensor-parallel over the 8 chips, the paged cache's kv heads split over "
            "them, every layer's new tokens attended by splitkv's ragged kernel (one call for "
            "the decoding sequences, one for the prompt chunks), which writes them into their "
            "pages (a bfloat16 cache, packed; an int8 cache's by core's page write first), then "
            "each decoding sequence's next token sampled. The step is "
            "padded to the engine's smallest token bucket that holds it. Its kernels are "
            "charged the loop runs and the pages their sequences hold, from the kernels' own "
            "modules (as the mixed steps' rows are). Tokens/s: one sampled token per decoding "
            "sequence over the step. A steady-state step stands for a whole run of fixed "
            "lengths: one slot prefills a prompt in chunks while the others decode, so that "
            "requests start as fast as they end; its tokens/s is the run's, as MaxText's "
            "engine's are (its prefill, insert and generate programs composed over the same "
            "run, estimated the same way). A row with figures in the sampling column charges its "
            "sampler's conditionals as slots sampling with top-k or top-p held by their 256 most "
            "likely tokens (a chat request; `sampler_branches`), its step if they sampled "
            "otherwise beside; a row without them (an earlier run) charged every branch each "
            "time, an upper bound. Calibrated: the scheduled step made a device time "
            "by the committed calibration, with the band of a serving run; the published "
            "measurement of the same model's run (its own lengths) is a point such a "
            f"calibration is fitted to, not a figure to hold an estimate against. {OVERLAP_NOTE}",
            "",
            *markdown_table(header, rows), ""]  # fmt: skip


def _sampling_cell(by_way: Mapping[str, Mapping[str, float]] | None) -> str:
    if not by_way:
        return MISSING
    from pallas_flash_bench.models.sampler_branches import SAMPLINGS

    return " / ".join(_ms(by_way[way]["scheduled"]) for way in SAMPLINGS)


def ablation_table(
    models: Sequence[Mapping[str, Any]], steps: Sequence[tuple[str, str]]
) -> list[str]:
    """``steps``: (what the row changes, workload name) in order."""
    by_name = {row["workload"]["name"]: row for row in models}
    rows = []
    for what, name in steps:
        row = by_name.get(name)
        if row is None:
            continue
        f = row.get("figures") or {}
        seconds = "decode_step_seconds" if row["workload"]["step"] == "serve" else "step_seconds"
        render = _ms if row["workload"]["step"] == "serve" else seconds_cell
        rows.append([what, num(f.get("compile_seconds")),
                     _failed(row) or ends_cell(f.get(seconds), render),
                     ends_cell(f.get("mfu"), percent), peak_hbm_cell(row)])  # fmt: skip
    if not rows:
        return []
    header = ["change (each row adds one to the row before)", "compile s (this host)",
              "step (static)", "MFU (static)", "peak HBM per chip"]  # fmt: skip
    return ["## What each optimisation buys (Llama-2-7B)", "",
            "Training rows: one step on v5e-256, 4 sequences of 2048 tokens per chip; serving "
            "rows: the decode step of the Llama-2-7B serving run. A program that does not fit "
            "has no schedule, so no time: the compiler's figure of what it needed stands in, "
            "and its compile time is until the compiler gave up. Compile times are this CPU "
            "host's, two compiles at once.",
            "", *markdown_table(header, rows), ""]  # fmt: skip


def sensitivity_table(models: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per model row, its headline figure (MFU of a train step, tokens/s of a serving run) as
    the schedule overlaps the collectives: static, calibrated (with its band), and with each
    assumed constant moved (`targets.SENSITIVITY`)."""
    rows = []
    for row in models:
        f = row.get("figures") or {}
        if row.get("error") or not f.get("sensitivity"):
            continue
        train = row["workload"]["step"] == "train"
        key, render = ("mfu", percent) if train else ("tokens_per_second", num)
        if (f.get(key) or {}).get("scheduled") is None:
            continue  # it did not fit: its table says what it needed
        cal = f.get("calibrated") or {}
        band = cal.get("band")
        calibrated = MISSING if not cal else render(cal[key])
        if cal:
            calibrated += " (no band)" if band is None else f" ±{percent(band)}"
        moved = [MISSING if v is None else render(v[key]) for v in f["sensitivity"].values()]
        rows.append([row["workload"]["name"], "MFU" if train else "tokens/s",
                     render((f.get(key) or {}).get("scheduled")), calibrated, *moved])  # fmt: skip
    if not rows:
        return []
    names = list(next(iter(r for r in models if (r.get("figures") or {}).get("sensitivity")))
                 ["figures"]["sensitivity"])  # fmt: skip
    header = ["workload", "figure", "static (scheduled)", "calibrated", *names]
    return ["## How the model rows move with the model's constants", "",
            "The headline figure as the schedule overlaps the collectives; calibrated: each "
            "program's step made a device time by the committed calibration (see "
            "docs/calibration.md; a train step's band is that of MaxText's step, a serving "
            "run's the widest of its programs' kinds); then the same step with each constant "
            "no measurement here "
            "checks moved the way that hurts (the interconnect at 70 % of its published "
            "bandwidth, every collective's latency and hop three times the assumed 10 us and "
            "1 us, HBM at 90 % of its 819 GB/s). A lead over a reference that does not hold "
            "in every column rests on that constant.", "",
            *markdown_table(header, rows), ""]  # fmt: skip


def breakdown_table(models: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per program: its compute by kind of op, the memory-bound share, the collectives, the
    loop counts and what could not be counted."""
    rows = []
    for row in models:
        for p in row.get("programs", []):
            e = p.get("estimate")
            if e is None:
                continue
            kinds = e["seconds_by_kind"]
            trips = ", ".join(f"{t}" if t is not None else "?" for t in e["loop_trips"].values())
            once = len(e["undetermined_loops"]) + len(e["ops_with_unknown_inner_loops"])
            unlisted = len(e.get("ops_without_listing", []))
            hidden = (row.get("figures") or {}).get("copies_hidden_seconds", {}).get(p["program"])
            copies = f"{seconds_cell(e['async_copy_seconds'])} ({seconds_cell(hidden)})"
            rows.append([row["workload"]["name"], p["program"], seconds_cell(e["compute_seconds"]),
                         seconds_cell(kinds["kernel"]), seconds_cell(kinds["matmul"]),
                         seconds_cell(kinds["other"]), copies,
                         seconds_cell(e["memory_bound_seconds"]),
                         seconds_cell(e["collective_seconds"]), len(e["collectives"]),
                         ends_cell({end: e.get(f"step_seconds_{end}")
                                    for end in model_figures.ENDS}, seconds_cell),
                         trips or MISSING, once, unlisted])  # fmt: skip
    if not rows:
        return []
    header = ["workload", "program", "compute", "Pallas kernels", "MXU-bound XLA ops",
              "other XLA ops", "of which async copies (hidden)", "HBM-bound",
              "collectives (model)", "collectives",
              "step: scheduled (hidden .. exposed)", "loop trips", "counted once",
              "no listing"]  # fmt: skip
    return ["## What the model estimates are made of", "",
            "Compute: every scheduled op, its runs (loop trip counts from the HLO) times the "
            "larger of its static cycles and its HBM bytes over the bandwidth. Collectives: the "
            "ICI model (docs/benchmarks.md); the step as the schedule overlaps them. Async "
            "copies: the weights XLA prefetches into VMEM and other started copies, charged in "
            "full in the compute; in brackets, what of them the schedule hides beside the "
            "compute alone (the all-hidden end). "
            "Counted once: loops or ops whose trip count the HLO does not give (their time is "
            "then a lower bound). No listing: ops the LLO dump has no program for "
            "(asynchronous copies, scalar bookkeeping), charged their HBM bytes only.", "",
            *markdown_table(header, rows), ""]  # fmt: skip


def model_sections(results: Mapping[str, Any]) -> list[str]:
    """Every model section of the report (none when the run had no model workloads)."""
    models = list(results.get("models") or [])
    if not models:
        return []
    steps = [tuple(step) for step in results.get("ablation") or []]
    return [*training_table(models), *serving_table(models), *engine_table(models),
            *sensitivity_table(models),
            *ablation_table(models, steps), *breakdown_table(models)]  # fmt: skip
