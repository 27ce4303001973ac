"""``pallas-flash inspect``: one program's HLO around its kernels, memory and static schedule."""

from __future__ import annotations

from tqdm import tqdm

from pallas_flash_bench.kernels import row_figures
from pallas_flash_bench.kernels.references import all_subjects
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_bench.runs.workers import run_workers
from pallas_flash_estimate.read import hlo
from pallas_flash_estimate.targets import Target

GiB = 1 << 30


def inspect_kernel(subject_id: str, workload: Workload, target: Target) -> str:
    """Compiles one subject on one workload for the target and describes the result."""
    subjects = all_subjects("default", None, True)
    if subject_id not in subjects:
        known = ", ".join(subjects)
        raise SystemExit(f"pallas-flash inspect: unknown --backend {subject_id!r}; known: {known}")
    job = {"id": 0, "kind": "row", "subject": subject_id, "workload": workload.to_json(),
           "sweep": "default", "backends": None, "references": True, "target": target.name,
           "topology": target.topology, "keep_hlo": True}  # fmt: skip
    with tqdm(total=1, desc=f"compiling for {target.name}", leave=False) as progress:
        row = run_workers([job], 1, progress)[0]
    if row is None:
        return f"{subject_id} does not support {workload.label}"
    if "job_error" in row:
        return f"{subject_id} on {workload.label}: {row['job_error']}"
    lines = [f"# {subject_id} — {workload.label} — {target.name}"]
    if not row["compiled"]:
        return "\n".join([*lines, f"did not compile: {row['error']}"])
    hbm = row["hbm"]
    lines.append(
        f"HBM: temp {hbm['temp'] / GiB:.3f} GiB, arguments {hbm['argument'] / GiB:.3f} GiB, "
        f"outputs {hbm['output'] / GiB:.3f} GiB; "
        f"fits in {target.hbm_bytes / GiB:.0f} GiB: {hbm['fits']}"
    )
    lines.append("\n## Entry computation (optimised HLO)")
    for op in hlo.parse_entry(row["hlo"]):
        lines.append(
            f"  {op.name} = {op.opcode} {op.shape} ({op.bytes} bytes) {op.detail}".rstrip()
        )
    lines.append("\n## Copy trap")
    lines += [
        f"  {c['opcode']} {c['name']} {c['shape']}: {c['bytes']} bytes {c['detail']}"
        for c in row["copies"]
    ]
    if not row["copies"]:
        lines.append("  none: no copy, transpose or pad in the entry computation")
    if workload.chips > 1:
        lines.append("\n## Collectives (what crosses the interconnect, per chip)")
        lines += [f"  {c['opcode']} {c['name']}: {c['bytes']} bytes" for c in row["collectives"]]
        if not row["collectives"]:
            lines.append("  none")
    lines.append("\n## Kernels (static VLIW schedule)")
    for k in row["kernels"]:
        use = ", ".join(f"{unit} {100 * frac:.0f}%" for unit, frac in k["utilization"].items())
        lines.append(
            f"  {k['name']}: {k['bundles_per_step']} bundles/step x {k['steps']} steps "
            f"(grid {k['grid']}), {k['predicated_bundles']} predicated; {k['cycles']} cycles; "
            f"mxu ops {k['mxu_ops']}, spills {k['spill_stores']}, fills {k['fill_loads']}; "
            f"VMEM {k['vmem_bytes'] / (1 << 20):.2f} MiB; "
            f"cycles: {k['cycles_from']}\n    slot use: {use}"
        )
        if k.get("estimates"):
            steps = k["steps"] or 1
            per_step = ", ".join(
                f"{name} {value / steps:,.0f}" if value is not None else f"{name} —"
                for name, value in k["estimates"].items()
            )
            lines.append(f"    cycles per grid step by estimate: {per_step}; pushes {k['pushes']}")
        if k.get("dma_bytes") is not None:
            dma = row_figures.dma_cycles(k["dma_bytes"], target) / (k["steps"] or 1)
            lines.append(
                f"    DMA per grid step: {k['dma_bytes'] / (k['steps'] or 1) / (1 << 20):.3f} MiB "
                f"at most, {dma:,.0f} cycles at {target.hbm_bandwidth / 1e9:.0f} GB/s, against "
                f"{k['cycles'] / (k['steps'] or 1):,.0f} cycles of compute"
            )
    if not row["kernels"]:
        lines.append("  no Pallas kernel in this program")
    lines += [f"note: {n}" for n in row["notes"]]
    return "\n".join(lines)
