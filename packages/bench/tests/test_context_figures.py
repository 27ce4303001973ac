"""Context-parallel workloads: their shape, the busiest device's pairs, their figures against
one chip's time per token pair, and their report section."""

from __future__ import annotations

import pytest

from pallas_flash_bench.context import context_figures, context_steps
from pallas_flash_bench.context.context_workloads import (
    ContextWorkload,
    default_context,
    quick_context,
)
from pallas_flash_bench.views import context_report
from pallas_flash_estimate.read import hlo
from pallas_flash_estimate.targets import TARGETS

RING_WITH_TWO_HEAD_GROUPS = """HloModule ring

ENTRY %main (q: bf16[1,8,4096,128]) -> (bf16[1,8,4096,128], f32[1,8,1,4096]) {
  %q = bf16[1,8,4096,128]{3,2,1,0} parameter(0)
  ROOT %pallas_flash_forward.3 = (bf16[1,8,4096,128]{3,2,1,0}, f32[1,8,1,4096]{3,2,1,0}) \
custom-call(%q), custom_call_target="tpu_custom_call"
}
"""


def test_the_head_groups_are_read_from_the_compiled_forward_kernel() -> None:
    """16 query heads, a forward kernel whose output holds 8 of them: two groups in turn."""
    w = ContextWorkload("v5e-4", 65_536)
    comps = hlo.parse_computations(RING_WITH_TWO_HEAD_GROUPS)
    other = hlo.parse_computations(
        RING_WITH_TWO_HEAD_GROUPS.replace("pallas_flash_forward", "other")
    )
    assert w.q_heads == 16
    assert context_steps.kernel_head_groups(w, comps) == 2
    with pytest.raises(ValueError, match="calls no pallas_flash_forward kernel"):
        context_steps.kernel_head_groups(w, other)


def test_a_context_workload_needs_a_slice_and_a_known_layout() -> None:
    with pytest.raises(ValueError, match="target: expected a slice of several chips"):
        ContextWorkload("v5e-1", 65_536)
    with pytest.raises(ValueError, match="layout: expected one of"):
        ContextWorkload("v5e-4", 65_536, layout="striped")
    w = ContextWorkload("v5e-4", 262_144)
    assert w.chips == 4 and w.name == "N=262,144 causal zigzag on v5e-4"
    assert w.pair_ratio == pytest.approx(4.0)  # (262,144 / 131,072)^2, causal both
    assert ContextWorkload(**w.to_json()) == w
    assert {c.target for c in default_context()} == {"v5e-4", "v5e-16"}
    assert all(c.reference_len < c.seq_len for c in (*default_context(), *quick_context()))


def test_the_busiest_device_sets_the_branch_shares() -> None:
    zigzag = context_steps.busiest_pairs(ContextWorkload("v5e-4", 65_536))
    assert zigzag == {"skip": 7, "diagonal": 2, "unmasked": 7}
    contiguous = ContextWorkload("v5e-4", 65_536, layout="contiguous")
    assert context_steps.busiest_pairs(contiguous) == {"skip": 0, "diagonal": 1, "unmasked": 3}


def _program(name: str, steps: tuple[float, float, float] | None, **kw) -> dict:
    estimate = None
    if steps is not None:
        ends = ("overlapped", "scheduled", "exposed")
        estimate = {f"step_seconds_{end}": s for end, s in zip(ends, steps, strict=True)}
        estimate["collectives"] = kw.pop("collectives", [])
        estimate["collective_seconds"] = 0.5
    return {"program": name, "compiled": steps is not None, "estimate": estimate,
            "hbm": {"peak": 10 << 30} if steps is not None else None, **kw}  # fmt: skip


def test_figures_hold_the_step_against_a_share_of_one_chip_per_pair() -> None:
    w = ContextWorkload("v5e-4", 262_144)
    permutes = [{"bytes": 64 << 20, "runs": 3}, {"bytes": 128 << 20, "runs": 1}]
    result = {"workload": w.to_json(), "head_groups": 1,
              "programs": [_program("ring", (1.4, 1.45, 1.5), collectives=permutes),
                           _program("one chip", (1.3, 1.3, 1.31))]}  # fmt: skip
    f = context_figures.derive(result, TARGETS["v5e-4"])
    # a quarter of one chip's 131,072 tokens, times 4 for the pairs of twice the tokens
    assert f["share_seconds"]["overlapped"] == pytest.approx(1.3 * 4 / 4)
    assert f["against_share"]["exposed"] == pytest.approx(1.5 / 1.31)
    assert f["collective_bytes"] == 3 * (64 << 20) + (128 << 20)
    flops = w.attention(w.seq_len).useful_flops
    assert f["mfu"]["scheduled"] == pytest.approx(flops / 1.45 / (4 * TARGETS["v5e-4"].peak_flops))
    assert f["fits"] and f["peak_hbm"] == 10 << 30
    rows = context_report.context_section({"context": [{**result, "error": None, "figures": f}]})
    assert "## Context parallelism (v5e slices)" in rows
    (line,) = [r for r in rows if r.startswith("| N=262,144")]
    assert "1.45 s (1.4 s .. 1.5 s)" in line and "(N=131,072)" in line


def test_a_ring_that_does_not_fit_says_what_it_needed() -> None:
    w = ContextWorkload("v5e-4", 2_097_152)
    result = {"workload": w.to_json(), "head_groups": 16,
              "programs": [_program("ring", None, needed_bytes=20 << 30),
                           _program("one chip", (1.3, 1.3, 1.3))]}  # fmt: skip
    f = context_figures.derive(result, TARGETS["v5e-4"])
    assert not f["fits"] and f["peak_hbm"] == 20 << 30
    assert f["step_seconds"]["scheduled"] is None and f["against_share"]["scheduled"] is None
    section = context_report.context_section({"context": [{**result, "error": None, "figures": f}]})
    (line,) = [r for r in section if r.startswith("| N=")]
    assert "does not fit: needs 20 GiB" in line


@pytest.mark.parametrize(
    ("flags", "expected"),
    [([], default_context()), (["--quick"], quick_context()), (["--context"], default_context()),
     (["--quick", "--context"], default_context()), (["--ops", "forward"], []),
     (["--models"], []), (["--serving"], [])],
)  # fmt: skip
def test_which_context_rows_a_command_runs(flags: list[str], expected: list) -> None:
    from pallas_flash_bench import cli

    args = cli._parser().parse_args(["bench", *flags])
    notes: list[str] = []
    assert cli._context(args, notes) == expected
    if "--context" in flags:  # nothing else
        assert cli._workloads(args) == [] and cli._models(args, notes) == []
    assert notes == []


def test_rows_whose_package_is_not_installed_are_left_out_with_a_note(monkeypatch) -> None:
    """Installed with the xla backend only: no context rows (they need pallas), no model rows
    (pallas or splitkv); without the LLaMa package, no model rows either. Each says why."""
    import importlib.util

    import pallas_flash as pf
    from pallas_flash_bench import cli

    xla_only = [b for b in pf.list_backends() if b.name == "xla"]
    monkeypatch.setattr(pf, "list_backends", lambda: xla_only)
    args, notes = cli._parser().parse_args(["bench"]), []
    assert cli._context(args, notes) == [] and cli._models(args, notes) == []
    assert notes == [
        "backend pallas not installed: no context-parallel rows",
        "backend pallas, splitkv not installed: no model rows that use it",
    ]
    find_spec = importlib.util.find_spec

    def no_llama(name: str, *args):
        return None if name == "pallas_flash_llama" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", no_llama)
    notes.clear()
    assert cli._models(args, notes) == []
    assert notes == ["pallas-flash-llama is not installed: no model rows"]
