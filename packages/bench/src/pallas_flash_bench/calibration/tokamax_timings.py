"""tokamax's shipped autotuning data as calibration points: the times its autotuner measured
on real chips, ``tokamax/data/autotuning/<chip>/<op>.json`` of the installed tokamax.

Each file maps a call's bound arguments (JSON: shapes such as ``bf16[4,4096,16,128]``, the
mask, ``return_residuals``) to the configuration tokamax chose for it and that
configuration's ``evaluation_times_ms`` (profiled on the device); an untimed key is ``{}``.
A point is the call compiled at its chosen configuration (`calibration_programs`), measured
by the median of its times. Three files are read:

- ``pallas_mosaic_tpu_ragged_dot.json``: the forward grouped matmul (kind read from the
  estimate, as any program's). Most keys of v5p and v6e give only the groups' count and
  total size, not the sizes: those are left out, as ``batched_rpa.json`` is (no lengths);
- ``pallas_mosaic_tpu_flash_attention.json``: the forward flash attention, causal or not, with
  or without residuals (kind ``attention forward``). Keys with a bias, soft cap, dropout,
  paging, window or other mask are left out: the bench compiles plain attention only;
- ``pallas_mosaic_tpu_flash_attention_vjp.json``: its backward (kind ``attention
  backward``), the gradients from the forward's residuals, output and cotangent, on the same
  plain keys (timed on v7x only).

Which points the fit sees (``role``): on v5e, the grouped matmul `V5E_FIT` (v5e's other
sources, the guides and MaxText, validate it with the rest); on v5p and v6e, half of each
file's usable keys, chosen by a hash of the key (`fitted`); on v7x none
(`calibration.COEFFICIENTS_FROM`): it shows how the model carries to a generation it never
saw.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from pallas_flash_bench.calibration import calibration_programs
from pallas_flash_bench.calibration.calibration_point import CalibrationPoint, Role
from pallas_flash_estimate.aot.program_ref import ArraySpec, ProgramRef
from pallas_flash_estimate.calibration import ATTENTION, ATTENTION_BACKWARD, COEFFICIENTS_FROM

CHIPS = {"v5e": "tpu_v5_lite", "v5p": "tpu_v5", "v6e": "tpu_v6_lite", "v7x": "tpu7x"}
"""tokamax's folder of autotuning data for each TPU generation."""

V5E_FIT = ("bf16[131072,2048]", "bf16[128,2048,768]")
"""The v5e grouped matmul (lhs, rhs) the v5e calibration is fitted on."""


DTYPES = {"bf16": "bfloat16", "f32": "float32"}

FLASH_ATTENTION = "pallas_mosaic_tpu_flash_attention"
"""tokamax's data file (op name) of its Mosaic TPU flash attention forward."""

FLASH_ATTENTION_VJP = "pallas_mosaic_tpu_flash_attention_vjp"
"""tokamax's data file of the same kernel's backward (its VJP op)."""


def source(generation: str, op: str) -> str:
    """The points' source: the installed tokamax's data file for ``generation``."""
    version = importlib.metadata.version("tokamax")
    return (f"tokamax {version}'s shipped autotuning data, tokamax/data/autotuning/"
            f"{CHIPS[generation]}/{op}.json (median of its evaluation times, profiled on a "
            f"TPU {generation})")  # fmt: skip


def fitted(generation: str, key: str) -> bool:
    """Whether the fit sees a key of ``generation``'s data: on v5p and v6e the keys whose
    SHA-256 is even (about half, fixed by the key alone); never on one only validated
    (`calibration.COEFFICIENTS_FROM`)."""
    if generation in COEFFICIENTS_FROM:
        return False
    return hashlib.sha256(key.encode()).digest()[-1] % 2 == 0


def points(generation: str) -> list[CalibrationPoint]:
    """Every usable timed key of ``generation``'s grouped matmul and flash attention (forward
    and backward); none when tokamax is not installed or has no data for it."""
    return [*ragged_dot_points(generation), *flash_attention_points(generation),
            *flash_attention_vjp_points(generation)]  # fmt: skip


def data_file(generation: str, op: str) -> dict[str, dict]:
    """The installed tokamax's data file of ``op`` for ``generation``; empty without one."""
    try:
        folder = importlib.resources.files("tokamax") / "data" / "autotuning" / CHIPS[generation]
        return json.loads((folder / f"{op}.json").read_text())
    except (ModuleNotFoundError, FileNotFoundError, KeyError):
        return {}


def timed(generation: str, op: str) -> Iterator[tuple[str, dict[str, Any], dict, float]]:
    """(key, call, config, median seconds) of each timed configuration of each key of one
    data file (most keys store one, the chosen)."""
    for key, configs in data_file(generation, op).items():
        for config_key, timed in configs.items():
            seconds = float(np.median(timed["evaluation_times_ms"])) / 1e3
            yield key, json.loads(key), json.loads(config_key), seconds


def array(text: Any) -> ArraySpec | None:
    """The array of a key's ``bf16[4,4096,16,128]``; None for any other (a quantized
    array's description)."""
    if not isinstance(text, str) or text.split("[")[0] not in DTYPES:
        return None
    dtype, dims = text.rstrip("]").split("[")
    return ArraySpec(tuple(int(d) for d in dims.split(",")), DTYPES[dtype])


def _role(generation: str, key: str, call: Mapping[str, Any]) -> Role:
    if generation == "v5e":
        return "fit" if (call["lhs"], call["rhs"]) == V5E_FIT else "validate"
    return "fit" if fitted(generation, key) else "validate"


def gmm_steps(group_sizes: list[int], tiles: Mapping[str, int], k: int, n: int) -> int:
    """The grid steps of tokamax's forward grouped matmul, ``(n / tile_n, m tiles visited,
    k / tile_k)``, whose middle size is computed at run time: per non-empty group, the m tiles
    its rows touch (its start rounded down, its end up)."""
    tile_m = tiles["tile_m"]
    visited, start = 0, 0
    for size in group_sizes:
        if size:
            visited += math.ceil((start + size) / tile_m) - start // tile_m
        start += size
    return n // tiles["tile_n"] * visited * (k // tiles["tile_k"])


def gmm_kernel() -> str:
    """The name of tokamax's forward grouped matmul kernel, whose grid ``loop_trips`` give:
    ``pallas_tpu_ragged_dot_gmm`` from tokamax 0.0.17 (its ``_KERNEL_NAME_GMM``),
    ``gmm_megablox`` before."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu_kernel

    return getattr(pallas_mosaic_tpu_kernel, "_KERNEL_NAME_GMM", "gmm_megablox")


def ragged_dot_points(generation: str) -> list[CalibrationPoint]:
    """tokamax's grouped matmul (forward, no residuals, lhs ``[m, k]`` @ rhs
    ``[groups, k, n]``) at each shape ``generation``'s data times, in the configuration
    timed."""
    op = "pallas_mosaic_tpu_ragged_dot"
    module = calibration_programs.__name__
    found = []
    for key, call, config, seconds in timed(generation, op):
        lhs, rhs = array(call["lhs"]), array(call["rhs"])
        if lhs is None or rhs is None:
            continue
        numbers = call["ragged_dot_dimension_numbers"]
        plain = numbers["dot_dimension_numbers"] == [[[1], [1]], [[], []]] and len(rhs.shape) == 3
        groups = call["group_sizes"]
        if not isinstance(groups, list):
            continue  # only the groups' count and total: no program to compile
        if call["return_residuals"] or call["activation"] or not plain:
            continue
        if config.get("combine_scopes") or call.get("fuse_gateup_activation"):
            continue
        kwargs = {k: config[k] for k in ("tile_m", "tile_k", "tile_n", "input_buffer_count")}
        m, k = lhs.shape
        steps = gmm_steps(groups, config, k, rhs.shape[2])
        ref = ProgramRef(f"{module}:tokamax_ragged_dot",
                         (lhs, rhs, ArraySpec((len(groups),), "int32")),
                         tuple(sorted(kwargs.items())), ((gmm_kernel(), (steps,)),))  # fmt: skip
        name = (f"tokamax ragged_dot {m}x{k} @ {len(groups)}x{rhs.shape[1]}x{rhs.shape[2]}, "
                f"tiles {config['tile_m']}/{config['tile_k']}/{config['tile_n']}")  # fmt: skip
        found.append(CalibrationPoint(name, ref, seconds, source(generation, op), "device",
                                      _role(generation, key, call)))  # fmt: skip
    return found


PLAIN_ATTENTION = {
    "bias": None, "logits_soft_cap": None, "dropout_mask": None, "dropout_rate": 0.0,
    "paging_info": None, "q_indices": None, "k_indices": None, "normalize_output": True,
    "logits_dtype": "float32",
}  # fmt: skip
"""The bound arguments of a flash attention key the bench compiles (plain attention)."""

PLAIN_MASK = {"bool_mask": None, "q_start": None, "q_end": None, "k_start": None, "k_end": None}


def causal_of(call: Mapping[str, Any]) -> bool | None:
    """Whether a flash attention key is causal: False without a mask, True with a causal mask
    at offset 0 and no window; None for any other mask, bias, soft cap or setting
    (`PLAIN_ATTENTION`), or a logits scale other than ``1 / sqrt(head_dim)``."""
    if any(call.get(name) != value for name, value in PLAIN_ATTENTION.items()):
        return None
    if any(array(call[name]) is None for name in ("q", "k", "v")):
        return None
    if call["precision"] != [["DEFAULT", "DEFAULT"], ["DEFAULT", "DEFAULT"]]:
        return None
    head_dim = array(call["q"]).shape[-1]
    if not math.isclose(call["logits_scale"], head_dim**-0.5, rel_tol=1e-6):
        return None
    mask = call["mask"]
    if mask is None:
        return False
    if any(mask.get(name) != value for name, value in PLAIN_MASK.items()):
        return None
    causal = mask.get("causal_mask")
    if causal is None:
        return False
    return True if causal == {"offset": 0, "window_size": None} else None


def flash_attention_program(call: Mapping[str, Any], config: Mapping[str, Any], causal: bool,
                            residuals: bool) -> ProgramRef:  # fmt: skip
    """tokamax's flash attention forward on a key's q, k and v at ``config``
    (`calibration_programs.tokamax_flash_attention`)."""
    kwargs = {"config": json.dumps(config, sort_keys=True), "causal": causal,
              "residuals": residuals}  # fmt: skip
    return ProgramRef(f"{calibration_programs.__name__}:tokamax_flash_attention",
                      tuple(array(call[n]) for n in ("q", "k", "v")),
                      tuple(sorted(kwargs.items())))  # fmt: skip


def flash_attention_points(generation: str) -> list[CalibrationPoint]:
    """tokamax's Mosaic TPU flash attention forward (q ``[batch, seq, heads, head_dim]``) at
    each plain shape (`causal_of`) ``generation``'s data times, in the configuration timed."""
    found = []
    for key, call, config, seconds in timed(generation, FLASH_ATTENTION):
        causal = causal_of(call)
        if causal is None:
            continue
        residuals = bool(call["return_residuals"])
        ref = flash_attention_program(call, config, causal, residuals)
        blocks = "/".join(str(config.get(k)) for k in ("block_q", "block_kv", "block_kv_compute"))
        what = ", ".join(["causal" if causal else "full", *(["residuals"] if residuals else [])])
        name = (f"tokamax flash attention q {call['q']} kv {call['k']}, {what}, "
                f"blocks {blocks}")  # fmt: skip
        role = _role(generation, key, call)
        found.append(CalibrationPoint(name, ref, seconds, source(generation, FLASH_ATTENTION),
                                      "device", role, kind=ATTENTION))  # fmt: skip
    return found


def flash_attention_vjp_program(call: Mapping[str, Any], config: Mapping[str, Any],
                                causal: bool) -> ProgramRef:  # fmt: skip
    """tokamax's flash attention backward on a VJP key's residuals, output, cotangent, q, k
    and v at ``config`` (`calibration_programs.tokamax_flash_attention_vjp`)."""
    kwargs = {"config": json.dumps(config, sort_keys=True), "causal": causal}
    arrays = (*call["residuals"], call["out"], call["dout"], call["q"], call["k"], call["v"])
    return ProgramRef(f"{calibration_programs.__name__}:tokamax_flash_attention_vjp",
                      tuple(array(a) for a in arrays), tuple(sorted(kwargs.items())))  # fmt: skip


def flash_attention_vjp_points(generation: str) -> list[CalibrationPoint]:
    """tokamax's Mosaic TPU flash attention backward at each plain shape (`causal_of`)
    ``generation``'s VJP data times, in the configuration timed."""
    found = []
    for key, call, config, seconds in timed(generation, FLASH_ATTENTION_VJP):
        causal = causal_of(call)
        if causal is None or any(array(r) is None for r in call["residuals"]):
            continue
        ref = flash_attention_vjp_program(call, config, causal)
        blocks = "/".join(str(config.get(k)) for k in
                          ("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute"))  # fmt: skip
        name = (f"tokamax flash attention backward q {call['q']} kv {call['k']}, "
                f"{'causal' if causal else 'full'}, blocks {blocks}")  # fmt: skip
        found.append(CalibrationPoint(name, ref, seconds, source(generation, FLASH_ATTENTION_VJP),
                                      "device", _role(generation, key, call),
                                      kind=ATTENTION_BACKWARD))  # fmt: skip
    return found
