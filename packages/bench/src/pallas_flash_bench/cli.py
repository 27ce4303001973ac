"""The ``pallas-flash`` command: ``bench`` (the sweep and its report), ``inspect`` (one
kernel), ``readme`` (the README's report block from a run)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import pathlib
import sys
from collections.abc import Callable

import pallas_flash as pf
from pallas_flash_bench.kernels.sweeps import (
    default_sweep,
    quick_sweep,
    ragged_sweep,
    serving_sweep,
    step_sweep,
    window_sweep,
)
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_bench.runs.cache import ResultCache, default_dir
from pallas_flash_estimate.targets import DEFAULT_TARGET, TARGETS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pallas-flash", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser(
        "bench", help="compile the sweep for a TPU target and write the report"
    )
    bench.add_argument("--target", choices=sorted(TARGETS), default=DEFAULT_TARGET)
    bench.add_argument(
        "--quick", action="store_true", help="a small sweep (about 20 minutes on 2 CPU cores)"
    )
    bench.add_argument(
        "--serving",
        action="store_true",
        help="only the serving sweep: decode batches (ragged lengths, paged and int8 caches), "
        "mixed prefill+decode steps against RPA v3 (with --ops ragged, only those) and the "
        "serving engine's steps on v5e-8 (Llama-2-7B, Llama-3-8B)",
    )
    bench.add_argument(
        "--steps",
        action="store_true",
        help="only the serving-step matrix: pf.ragged_attention against RPA v3 at one chip's "
        "share of Llama-3-8B's heads (1, 2, 4 and 8 kv heads), pages of 16, 64 and 128, "
        "decode-only and mixed steps",
    )
    bench.add_argument(
        "--windows",
        action="store_true",
        help="only the windowed layers' steps: pf.ragged_attention against RPA v3 at windows "
        "of 4096 and 1024 and without one (Mistral-7B's heads over 4 chips, pages of 16)",
    )
    bench.add_argument(
        "--models",
        action="store_true",
        help="only the model workloads: LLaMa train steps and serving runs on v5e slices "
        "against MaxText and JetStream, and the ablation (needs pallas-flash-llama)",
    )
    bench.add_argument(
        "--context",
        action="store_true",
        help="only the context-parallel workloads: one sequence's forward+backward over a v5e "
        "slice against one chip's time per token pair",
    )
    bench.add_argument(
        "--calibrate",
        action="store_true",
        help="only the calibration: compile every program with a published time on the "
        "target's generation, fit what the static estimate misses and print each kind's error "
        "band (calibration.json, .md)",
    )
    bench.add_argument(
        "--rank-configs",
        action="store_true",
        help="only the ranking of tokamax's flash attention configurations by the estimate, at "
        "shapes tokamax timed on the target's generation (ranking.json, .md; tokamax needed)",
    )
    bench.add_argument(
        "--against-tokamax",
        action="store_true",
        help="only our pallas kernels beside tokamax's at every shape tokamax timed on the "
        "target's generation, forward and, where timed, backward (comparison.json, .md; "
        "tokamax needed)",
    )
    bench.add_argument(
        "--all-layouts",
        action="store_true",
        help="with --rank-configs: every q, k and v layout of tokamax's space, not the pick's",
    )
    bench.add_argument("--backends", help="comma-separated backend names (default: all installed)")
    bench.add_argument("--no-reference", action="store_true", help="leave out jax's own kernels")
    bench.add_argument(
        "--ops", help="comma-separated subset of forward,forward_backward,decode,ragged"
    )
    bench.add_argument("--seq-lens", help="comma-separated sequence lengths (replaces the sweep's)")
    bench.add_argument("--dtype", default=None, help="input dtype (default bfloat16)")
    bench.add_argument(
        "--price", type=float, help="US dollars per chip-hour (default: the target's list price)"
    )
    bench.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-results"))
    bench.add_argument("--cache-dir", type=pathlib.Path, default=default_dir())
    bench.add_argument("--no-cache", action="store_true")
    bench.add_argument("--no-fit", action="store_true", help="skip the longest-sequence search")
    bench.add_argument("--no-measure", action="store_true", help="skip wall-clock timing")
    bench.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))

    inspect = commands.add_parser("inspect", help="print one kernel's analysis")
    inspect.add_argument("--backend", required=True, help="backend name or reference subject id")
    inspect.add_argument("--shape", default="1x16x4096x128", help="BATCHxHEADSxSEQxHEAD_DIM")
    inspect.add_argument("--kv-heads", type=int, help="default: as many as query heads")
    inspect.add_argument(
        "--op", choices=["forward", "forward_backward", "decode"], default="forward"
    )
    inspect.add_argument("--causal", action="store_true")
    inspect.add_argument(
        "--chips", type=int, default=1, help="decode: split the cache over this many chips"
    )
    inspect.add_argument("--dtype", default="bfloat16")
    inspect.add_argument("--target", choices=sorted(TARGETS), default=DEFAULT_TARGET)

    estimate = commands.add_parser(
        "estimate", help="estimate any program: a function at the top level of a module"
    )
    estimate.add_argument("function", help="MODULE:FUNCTION, e.g. my_kernels:matmul")
    estimate.add_argument(
        "--arg", action="append", metavar="DTYPE[D0,D1,...]",
        help="an array argument's dtype and shape, e.g. bfloat16[4096,4096]; once per argument",
    )  # fmt: skip
    estimate.add_argument(
        "--kwarg", action="append", metavar="NAME=VALUE",
        help="a static keyword argument (VALUE read as JSON, else as a string)",
    )  # fmt: skip
    estimate.add_argument(
        "--trips",
        action="append",
        metavar="KERNEL=N[,N...]",
        help="a Pallas kernel whose grid is sized at run time: how often its loops run, "
        "outermost first",
    )
    estimate.add_argument("--target", choices=sorted(TARGETS), default="v5e-1")
    estimate.add_argument("--json", action="store_true", help="print the estimate as JSON")

    readme = commands.add_parser(
        "readme", help="rewrite the README's report block from a run's results.json"
    )
    readme.add_argument(
        "--results", type=pathlib.Path, default=pathlib.Path("docs/results/quick-v5e-4.json")
    )
    readme.add_argument(
        "--models",
        type=pathlib.Path,
        help="a `pallas-flash bench --models` run's results.json: rewrite the docs' models page",
    )
    readme.add_argument(
        "--only-models", action="store_true", help="leave the README's block as it is"
    )
    readme.add_argument(
        "--context",
        type=pathlib.Path,
        help="a `pallas-flash bench --context` run's results.json: rewrite the docs' context page",
    )
    readme.add_argument(
        "--newest",
        type=pathlib.Path,
        help="the same sweep's results.json on the newest stack (`nox -s bench-newest`): "
        "rewrite the docs' stacks page, beside --results",
    )
    readme.add_argument(
        "--serving",
        type=pathlib.Path,
        help="a `pallas-flash bench --serving --ops ragged` run's results.json: rewrite the "
        "docs' serving page (the mixed serving steps against RPA v3)",
    )
    readme.add_argument(
        "--steps",
        type=pathlib.Path,
        help="a `pallas-flash bench --steps` run's results.json: rewrite the docs' serving-step "
        "matrix page",
    )
    readme.add_argument(
        "--windows",
        type=pathlib.Path,
        help="a `pallas-flash bench --windows` run's results.json: rewrite the docs' windowed "
        "layers page",
    )
    readme.add_argument(
        "--calibration",
        type=pathlib.Path,
        help="a `pallas-flash bench --calibrate` run's calibration.json: rewrite the calibration "
        "page's block (--page) from it and leave the README alone",
    )
    readme.add_argument(
        "--ranking", type=pathlib.Path, action="append",
        help="a `pallas-flash bench --rank-configs` run's ranking.json (once per generation): "
        "rewrite the calibration page's ranking block (--page) from them",
    )  # fmt: skip
    readme.add_argument(
        "--against-tokamax", type=pathlib.Path, action="append",
        help="a `pallas-flash bench --against-tokamax` run's comparison.json (once per "
        "generation): rewrite the docs' tokamax page (tokamax.md under --docs) and the "
        "README's summary of it from them",
    )  # fmt: skip
    readme.add_argument(
        "--page", type=pathlib.Path, default=pathlib.Path("docs/calibration.md"),
        help="the calibration page (with --calibration or --ranking)",
    )  # fmt: skip
    readme.add_argument("--readme", type=pathlib.Path, default=pathlib.Path("README.md"))
    readme.add_argument(
        "--docs", type=pathlib.Path, default=pathlib.Path("docs"),
        help="the docs folder, whose generated pages (report.md, models.md) are rewritten too",
    )  # fmt: skip
    return parser


def _models(args: argparse.Namespace, notes: list[str]) -> list:
    """The model workloads: all with ``--models``, the serving engine's steps with
    ``--serving``, both in the full sweep, the quick sweep's one small row with ``--quick``;
    none without the LLaMa package, and none that needs a backend not installed (each left
    out with a note in ``notes``)."""
    selected = args.ops or args.seq_lens or args.context or args.steps or args.windows
    if selected and not args.serving:
        return []
    if importlib.util.find_spec("pallas_flash_llama") is None:
        _note(notes, "pallas-flash-llama is not installed: no model rows")
        return []
    from pallas_flash_bench.models import model_workloads

    if args.serving:
        models = model_workloads.engine_models()
    elif args.models:
        models = model_workloads.default_models()
    elif args.quick:
        models = model_workloads.quick_models()
    else:
        models = model_workloads.default_models() + model_workloads.engine_models()
    installed = {b.name for b in pf.list_backends()}
    missing = sorted({b for w in models for b in (w.backend, w.decode_backend)} - installed)
    if missing:
        _note(notes, f"backend {', '.join(missing)} not installed: no model rows that use it")
    return [w for w in models if {w.backend, w.decode_backend} <= installed]


def _context(args: argparse.Namespace, notes: list[str]) -> list:
    """The context-parallel workloads: the quick sweep's one small row with ``--quick``, else
    all; none for a sweep of other rows only, or without the pallas backend (with a note)."""
    from pallas_flash_bench.context import context_workloads

    if args.serving or args.steps or args.windows or args.ops or args.seq_lens or args.models:
        return []
    if "pallas" not in {b.name for b in pf.list_backends()}:
        _note(notes, "backend pallas not installed: no context-parallel rows")
        return []
    if args.quick and not args.context:
        return context_workloads.quick_context()
    return context_workloads.default_context()


def _note(notes: list[str], note: str) -> None:
    """A workload left out: said now, and in the report's notes."""
    print(f"pallas-flash bench: {note}", file=sys.stderr)
    notes.append(note)


def _workloads(args: argparse.Namespace) -> list[Workload]:
    chips = TARGETS[args.target].chips
    if args.models or args.context:
        return []
    if args.steps:
        sweep = step_sweep()
    elif args.windows:
        sweep = window_sweep()
    elif args.serving:
        sweep = serving_sweep(chips) + ragged_sweep() + _engine_attention()
    else:
        sweep = quick_sweep(chips) if args.quick else default_sweep(chips)
    if args.ops:
        ops = set(args.ops.split(","))
        sweep = [w for w in sweep if w.op in ops]
    if args.seq_lens:  # each kind of workload (all but its length) at each length, once
        lengths = [int(n) for n in args.seq_lens.split(",")]
        # their lengths are part of what they measure
        serving = {*serving_sweep(chips), *ragged_sweep(), *step_sweep(), *window_sweep()}
        kinds = [w for w in sweep if w not in serving]
        sweep = list(
            dict.fromkeys(dataclasses.replace(w, seq_len=n) for w in kinds for n in lengths)
        )
    if args.dtype:
        sweep = [Workload(**{**w.to_json(), "dtype": args.dtype}) for w in sweep]
    return sweep


def _engine_attention() -> list[Workload]:
    """The attention of the serving engine's steady-state steps on one chip (their share of
    the heads, `ModelWorkload.engine_mix`), to hold against RPA v3; none without the LLaMa
    package."""
    if importlib.util.find_spec("pallas_flash_llama") is None:
        return []
    from pallas_flash_bench.models import model_workloads

    steps = [w.engine_mix(w.mesh[2]) for w in model_workloads.engine_models() if w.mix is None]
    return list(dict.fromkeys(steps))


def _bench(args: argparse.Namespace) -> int:
    from pallas_flash_bench.runs.runner import BenchOptions, run

    target = TARGETS[args.target]
    if args.calibrate:
        return _calibrate(args)
    if args.rank_configs:
        return _rank_configs(args)
    if args.against_tokamax:
        return _against_tokamax(args)
    left_out: list[str] = []
    options = BenchOptions(
        target=target,
        sweep="quick" if args.quick else "default",
        workloads=_workloads(args),
        models=_models(args, left_out),
        context=_context(args, left_out),
        backends=args.backends.split(",") if args.backends else None,
        references=not args.no_reference,
        fit=not (args.no_fit or args.models or args.context or args.steps or args.windows),
        measure=not args.no_measure,
        price_per_chip_hour=args.price if args.price is not None else target.price_per_chip_hour,
        out_dir=args.out,
        cache=ResultCache(None if args.no_cache else args.cache_dir),
        workers=args.workers,
        notes=left_out,
    )
    results = run(options)
    rows = results["rows"] + results["models"] + results["context"]
    compiled = sum(bool(r.get("compiled") or (r.get("figures") or {}).get("compiled"))
                   for r in rows)  # fmt: skip
    where = f" for {target.name}" if results["rows"] else ""
    print(f"{compiled}/{len(rows)} workloads compiled{where}; "
          f"wrote {args.out}/report.md, results.json, roofline.png")  # fmt: skip
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from pallas_flash_bench.calibration import calibration_run
    from pallas_flash_bench.views import calibration_report

    return _generation_run(args, calibration_run.run, calibration_report.section, "calibration")


def _rank_configs(args: argparse.Namespace) -> int:
    from pallas_flash_bench.calibration import config_ranking

    rank = functools.partial(config_ranking.rank, all_layouts=args.all_layouts)
    return _generation_run(args, rank, config_ranking.section, "ranking")


def _against_tokamax(args: argparse.Namespace) -> int:
    from pallas_flash_bench.calibration import tokamax_comparison

    return _generation_run(args, tokamax_comparison.compare, tokamax_comparison.section,
                           "comparison")  # fmt: skip


def _generation_run(args: argparse.Namespace, run: Callable[..., dict],
                    section: Callable[[dict], list[str]], name: str) -> int:  # fmt: skip
    """``run(target, versions, cache, workers, out)`` of the target's generation (the
    calibration, the ranking, the comparison), its section printed; it writes ``name``.json
    and .md into ``--out``."""
    from pallas_flash_bench.runs.runner import versions

    cache = ResultCache(None if args.no_cache else args.cache_dir)
    found = run(TARGETS[args.target], versions(), cache, args.workers, args.out)
    print("\n".join(section(found)))
    print(f"wrote {args.out}/{name}.json and {name}.md")
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from pallas_flash_estimate import program_estimate
    from pallas_flash_estimate.aot.program_ref import ProgramRef, parse_array

    try:
        kwargs = dict(_keyword(text) for text in args.kwarg or ())
        trips = tuple(_trips(text) for text in args.trips or ())
        ref = ProgramRef(args.function, tuple(parse_array(a) for a in args.arg or ()),
                         tuple(sorted(kwargs.items())), trips)  # fmt: skip
        ref.function_object()
    except (ValueError, ImportError, AttributeError) as exc:
        raise SystemExit(f"pallas-flash estimate: {exc}") from exc
    found = program_estimate.estimate_ref(ref, TARGETS[args.target])
    print(json.dumps(dataclasses.asdict(found), indent=1) if args.json else found.summary())
    return 0


def _keyword(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--kwarg: expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def _trips(text: str) -> tuple[str, tuple[int, ...]]:
    name, sep, counts = text.partition("=")
    try:
        parsed = tuple(int(n) for n in counts.split(","))
    except ValueError:
        parsed = ()
    if not sep or not name or not parsed:
        raise ValueError(f"--trips: expected KERNEL=N[,N...], got {text!r}")
    return name, parsed


def _inspect(args: argparse.Namespace) -> int:
    from pallas_flash_bench.runs.inspection import inspect_kernel

    batch, heads, seq, head_dim = (int(x) for x in args.shape.lower().split("x"))
    workload = Workload(
        args.op, seq, args.causal, batch=batch, q_heads=heads,
        kv_heads=args.kv_heads or heads, head_dim=head_dim, dtype=args.dtype, chips=args.chips,
    )  # fmt: skip
    print(inspect_kernel(args.backend, workload, TARGETS[args.target]))
    return 0


def _readme(args: argparse.Namespace) -> int:
    from pallas_flash_bench.views import readme

    if args.calibration is not None:
        readme.update_calibration_page(args.page, json.loads(args.calibration.read_text()))
        print(f"{args.page}: rewritten from {args.calibration}")
        return 0
    if args.ranking:
        block = readme.render_ranking_block([json.loads(p.read_text()) for p in args.ranking])
        readme.update_page_block(args.page, block, readme.RANKING_BEGIN, readme.RANKING_END)
        print(f"{args.page}: its ranking rewritten from {' and '.join(map(str, args.ranking))}")
        return 0
    if args.against_tokamax:
        runs = [json.loads(p.read_text()) for p in args.against_tokamax]
        page = args.docs / "tokamax.md"
        readme.update_page_block(page, readme.render_tokamax_block(runs), readme.TOKAMAX_BEGIN,
                                 readme.TOKAMAX_END)  # fmt: skip
        readme.update_page_block(args.readme, readme.render_tokamax_summary(runs),
                                 readme.TOKAMAX_SUMMARY_BEGIN,
                                 readme.TOKAMAX_SUMMARY_END)  # fmt: skip
        print(f"{page} and {args.readme}: rewritten from "
              f"{' and '.join(map(str, args.against_tokamax))}")  # fmt: skip
        return 0
    results = None if args.only_models else json.loads(args.results.read_text())
    models = None if args.models is None else json.loads(args.models.read_text())
    context = None if args.context is None else json.loads(args.context.read_text())
    newest = None if args.newest is None else json.loads(args.newest.read_text())
    serving = None if args.serving is None else json.loads(args.serving.read_text())
    steps = None if args.steps is None else json.loads(args.steps.read_text())
    windows = None if args.windows is None else json.loads(args.windows.read_text())
    readme.update(args.readme, results, models, args.docs, context, newest, serving, steps,
                  windows)  # fmt: skip
    runs = ((args.results, results), (args.models, models), (args.context, context),
            (args.newest, newest), (args.serving, serving), (args.steps, steps),
            (args.windows, windows))  # fmt: skip
    sources = [str(p) for p, used in runs if used]
    print(f"{args.readme}: rewritten from {' and '.join(sources)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"bench": _bench, "estimate": _estimate, "inspect": _inspect, "readme": _readme}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
