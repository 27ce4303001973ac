"""``pallas-flash bench --rank-configs``: does the estimator pick what tokamax measured fastest?

At a few of the shapes tokamax timed on a generation (`RANKED_SHAPES`: forward, not causal, no
residuals), every configuration of tokamax's own flash attention autotuning space (its
``_get_autotuning_configs``: block sizes and the scheduler, at the q, k and v layouts of the
configuration tokamax picked, 24 of its 192; or all of them with ``all_layouts``) and the
pick itself are compiled and estimated like any program, then ranked by their calibrated
time (`pallas_flash_estimate.calibration`, the generation's attention band). The pick's rank
says whether a static autotuner would have chosen as tokamax's measurements did: first, or
within the band of the first.

Layout of ``ranking.json``: ``{"generation", "band", "versions", "shapes": [{"key", "q",
"measured_pick": {"config", "seconds"}, "configs": [{"config", "static_seconds",
"calibrated_seconds", "pick"}] (fastest first), "failed": [{"config", "error"}] (no estimate:
e.g. over the VMEM limit), "pick_rank", "within_band"}]}``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

from pallas_flash_bench.calibration import calibration_run, tokamax_timings
from pallas_flash_bench.runs.cache import ResultCache
from pallas_flash_bench.runs.workers import run_cached
from pallas_flash_bench.views.cells import markdown_table, ms
from pallas_flash_estimate import calibration
from pallas_flash_estimate.targets import Target

RANKED_SHAPES = ("bf16[16,1024,16,128]", "bf16[4,4096,16,128]", "bf16[1,16384,16,128]")
"""The q shapes ranked (k and v alike; forward, not causal, no residuals): a short, a middle
and a long sequence, each timed on v5p and v6e."""


@dataclasses.dataclass(frozen=True)
class RankedShape:
    """One timed key and the configurations to rank at it (the pick among them)."""

    key: str
    call: Mapping[str, Any]
    pick: Mapping[str, Any]
    measured_seconds: float
    configs: tuple[Mapping[str, Any], ...]


def _config_json(config: Any) -> dict[str, Any]:
    """A tokamax ``Config`` as its autotuning data writes it (layouts by value)."""
    fields = dataclasses.asdict(config)
    return {k: getattr(v, "value", v) for k, v in fields.items()}


def autotuning_space(call: Mapping[str, Any], all_layouts: bool, pick: Mapping[str, Any]
                     ) -> list[dict[str, Any]]:  # fmt: skip
    """tokamax's own autotuning configurations of the flash attention forward at ``call``'s
    shapes; without ``all_layouts``, those at ``pick``'s q, k and v layouts."""
    import jax
    from tokamax._src.ops.attention import pallas_mosaic_tpu as tpu

    q, k, v = (jax.ShapeDtypeStruct(tokamax_timings.array(call[n]).shape, "bfloat16")
               for n in ("q", "k", "v"))  # fmt: skip
    op = tpu.PallasMosaicTpuFlashAttention()
    space = [_config_json(c) for c in op._get_autotuning_configs(op.bind(q, k, v))]
    layouts = ("q_layout", "k_layout", "v_layout")
    if not all_layouts:
        space = [c for c in space if all(c[n] == pick[n] for n in layouts)]
    return sorted(space, key=lambda c: json.dumps(c, sort_keys=True))


def ranked_shapes(generation: str, all_layouts: bool = False) -> list[RankedShape]:
    """`RANKED_SHAPES` as ``generation``'s data times them, each with its space to rank."""
    found = []
    timed = tokamax_timings.timed(generation, tokamax_timings.FLASH_ATTENTION)
    for key, call, config, seconds in timed:
        plain = call["k"] == call["q"] and not call["return_residuals"]
        if call["q"] in RANKED_SHAPES and plain and tokamax_timings.causal_of(call) is False:
            space = autotuning_space(call, all_layouts, config)
            configs = tuple(space) + (() if config in space else (config,))
            found.append(RankedShape(key, call, config, seconds, configs))
    return sorted(found, key=lambda s: RANKED_SHAPES.index(s.call["q"]))


def rank(target: Target, versions: dict, cache: ResultCache, workers: int, out_dir: pathlib.Path,
         all_layouts: bool = False) -> dict:  # fmt: skip
    """Every configuration of each ranked shape compiled for ``target`` and ranked by its
    calibrated time; ``ranking.json`` and ``ranking.md`` written to ``out_dir``."""
    shapes = ranked_shapes(target.generation, all_layouts)
    programs = [tokamax_timings.flash_attention_program(s.call, c, causal=False, residuals=False)
                for s in shapes for c in s.configs]  # fmt: skip
    jobs = [dict(calibration_run.program_job(ref, target), id=i)
            for i, ref in enumerate(programs)]  # fmt: skip
    results = run_cached(jobs, versions, cache, workers, "tokamax configurations")
    band = calibration.level_band(calibration.load(target.generation), calibration.ATTENTION)
    job = iter(range(len(jobs)))  # the jobs in order: each shape's configurations in turn
    ranked = []
    for shape in shapes:
        rows, failed = [], []
        for config in shape.configs:
            result = results.get(next(job))
            figures = calibration_run.attention_figures(result, target.generation)
            if figures is None:
                error = calibration_run.error_of(result) or "no estimate"
                first = str(error).splitlines()[0].split(" while ")[0]
                failed.append({"config": dict(config), "error": first[:200]})
                continue
            rows.append({"config": dict(config), "static_seconds": figures["static_seconds"],
                         "calibrated_seconds": figures["calibrated_seconds"],
                         "pick": dict(config) == dict(shape.pick)})  # fmt: skip
        rows.sort(key=_seconds)
        ranked.append(_verdict(shape, rows, band) | {"failed": failed})
    found = {"generation": target.generation, "band": band, "versions": dict(versions),
             "all_layouts": all_layouts, "shapes": ranked}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ranking.json").write_text(json.dumps(found, indent=1) + "\n")
    (out_dir / "ranking.md").write_text("\n".join(section(found)) + "\n")
    return found


def _seconds(row: Mapping[str, Any]) -> float:
    """What a configuration is ranked by: its calibrated time, else its static one."""
    return row["calibrated_seconds"] or row["static_seconds"]


def _verdict(shape: RankedShape, rows: list[dict], band: float) -> dict:
    """The pick's rank among ``rows`` (fastest first) and whether it is within ``band`` of
    the first."""
    picks = [i for i, r in enumerate(rows) if r["pick"]]
    rank = picks[0] + 1 if picks else None
    within = bool(picks) and _seconds(rows[picks[0]]) <= _seconds(rows[0]) * (1 + band)
    return {"key": shape.key, "q": shape.call["q"],
            "measured_pick": {"config": dict(shape.pick), "seconds": shape.measured_seconds},
            "configs": rows, "pick_rank": rank, "within_band": within}  # fmt: skip


def _blocks(config: Mapping[str, Any]) -> str:
    blocks = "/".join(str(config[k]) for k in ("block_q", "block_kv", "block_kv_compute"))
    layouts = "".join("s" if config[k] == 2 else "h" for k in ("q_layout", "k_layout", "v_layout"))
    scheduler = ", new scheduler" if config.get("use_experimental_scheduler") else ""
    return f"{blocks} ({layouts}{scheduler})"


def section(found: Mapping[str, Any], heading: str = "###") -> list[str]:
    """A generation's ranking as Markdown: per shape, the pick's rank and the first three."""
    space = "all of its space" if found["all_layouts"] else "its space at the pick's layouts"
    lines = [f"{heading} {found['generation']}: tokamax's configurations ranked by the estimate",
             "", f"tokamax's flash attention forward, {space}, each compiled and calibrated "
             f"(jax {found['versions'].get('jax')}, libtpu {found['versions'].get('libtpu')}); "
             f"the pick is the configuration tokamax measured fastest; within the band: its "
             f"calibrated time within ±{found['band'] * 100:.1f} % of the first's. Layouts: q, k, "
             "v each h (head dim minor) or s (sequence minor).", ""]  # fmt: skip
    rows = []
    for s in found["shapes"]:
        top = s["configs"][:3]
        pick = next((r for r in s["configs"] if r["pick"]), None)
        failed = f" ({len(s['failed'])} gave no estimate)" if s["failed"] else ""
        rows.append([s["q"], f"{len(s['configs'])}{failed}", _blocks(s["measured_pick"]["config"]),
                     ms(s["measured_pick"]["seconds"]),
                     ms(pick["calibrated_seconds"]) if pick else "—",
                     s["pick_rank"] or "—", "yes" if s["within_band"] else "no",
                     "; ".join(f"{_blocks(r['config'])} {ms(r['calibrated_seconds'])}"
                               for r in top)])  # fmt: skip
    header = ("q (= k, v)", "configurations ranked", "tokamax's pick", "measured", "calibrated",
              "pick's rank", "within the band", "first three by the estimate")  # fmt: skip
    notes = [f"- {s['q']}, {_blocks(f['config'])}: {f['error']}"
             for s in found["shapes"] for f in s["failed"]]  # fmt: skip
    if notes:
        notes = ["", "Configurations that gave no estimate:", "", *notes]
    return [*lines, *markdown_table(header, rows), *notes, ""]


def committed(generation: str, results: pathlib.Path) -> dict | None:
    """The committed ranking of ``generation`` under ``results`` (docs/results/), if any."""
    path = results / f"tokamax-ranking-{generation}.json"
    return json.loads(path.read_text()) if path.is_file() else None
