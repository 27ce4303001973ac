"""Reference subjects: splash's fused backward, the scoped-VMEM limit, the quick sweep's size,
and tokamax present or absent."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

import pytest

from pallas_flash_bench import aot, cli
from pallas_flash_bench.kernels import references
from pallas_flash_bench.kernels.references import all_subjects
from pallas_flash_bench.kernels.sweeps import quick_sweep
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_bench.runs import runner, worker
from pallas_flash_estimate.aot.devices import libtpu_version
from pallas_flash_estimate.targets import TARGETS

needs_libtpu = pytest.mark.skipif(libtpu_version() is None, reason="libtpu is not installed")
needs_tokamax = pytest.mark.skipif(
    references._tokamax_unavailable() is not None, reason="tokamax is not installed"
)

FUSED = "jax-splash[blocks 1024/1024, kv compute 512, fused backward]"


@pytest.fixture
def no_tokamax(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tokamax" else find_spec(name, *a),
    )


def test_the_fused_splash_backward_is_built_for_forward_backward_only() -> None:
    for sweep in ("quick", "default"):
        fused = all_subjects(sweep, [], True)[FUSED]
        assert fused.build(Workload("forward_backward", 2048, causal=True), None) is not None
        assert fused.build(Workload("forward", 2048, causal=True), None) is None


def test_the_fused_backward_takes_no_dq_blocks() -> None:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    fused = references._splash_sizes(sk, references.SplashBlocks(1024, 1024, 256, fused=True))
    assert fused.use_fused_bwd_kernel and fused.has_backward_blocks
    assert (fused.block_q_dq, fused.block_kv_dq) == (None, None)
    assert (fused.block_kv_compute, fused.block_kv_dkv_compute) == (256, 256)
    separate = references._splash_sizes(sk, references.SplashBlocks(512, 1024, 1024))
    assert not separate.use_fused_bwd_kernel
    assert (separate.block_q_dq, separate.block_kv_dq) == (512, 1024)


def test_every_reference_is_compiled_with_the_whole_vmem_and_says_so() -> None:
    for sweep in ("quick", "default"):
        subjects = all_subjects(sweep, None, True).values()
        for s in subjects:
            assert s.whole_vmem == (s.kind == "reference")
            if s.kind == "reference":
                assert s.version.endswith("+whole-vmem")  # the cache key changes with it
    assert aot.whole_vmem_options(TARGETS["v5e-1"]) == {"xla_tpu_scoped_vmem_limit_kib": "131072"}
    assert aot.whole_vmem_options(TARGETS["v4"]) == {"xla_tpu_scoped_vmem_limit_kib": "16384"}
    assert "whole VMEM" in references.reference_notes()[0]


def test_a_configuration_runs_the_sequences_its_blocks_divide() -> None:
    flash = all_subjects("default", [], True)["jax-flash[blocks 4096/1024]"]
    assert flash.build(Workload("forward", 2048), None) is None
    assert flash.build(Workload("forward", 6144), None) is None
    assert flash.build(Workload("forward", 8192), None) is not None


def test_only_jax_flash_takes_a_bias() -> None:
    """jax ``flash_attention``'s ``ab`` is the one bias a reference kernel takes (splash and
    tokamax have none), with the inputs' batch axis: batch 1 only."""
    subjects = all_subjects("default", [], True)
    biased = Workload("forward", 4096, bias=True)
    takes = {s.name for s in subjects.values() if s.kind == "reference" and s.build(biased, None)}
    assert takes == {"jax-flash"}
    flash = subjects["jax-flash[blocks 1024]"]
    assert flash.build(Workload("forward", 4096, batch=2, bias=True), None) is None


def test_grouped_heads_go_to_splash_and_head_dim_64_to_both() -> None:
    """Splash takes fewer kv heads than query heads, jax ``flash_attention`` does not; both
    take head_dim 64; neither takes MLA's 192/128."""
    subjects = all_subjects("default", [], True)
    flash, splash = subjects["jax-flash[blocks 1024]"], subjects["jax-splash[blocks 1024/1024]"]
    grouped = Workload("forward", 4096, causal=True, q_heads=32, kv_heads=8, head_dim=64)
    assert splash.build(grouped, None) is not None
    assert flash.build(grouped, None) is None
    assert flash.build(dataclasses.replace(grouped, kv_heads=32), None) is not None
    mla = Workload("forward", 4096, causal=True, head_dim=192, v_head_dim=128)
    assert splash.build(mla, None) is None and flash.build(mla, None) is None


def test_the_quick_sweep_is_a_few_previous_bests_of_the_default_one() -> None:
    quick = all_subjects("quick", [], True)
    # beyond the default's: a quick configuration's fallback where it does not apply, which
    # the default sweep tries everywhere (`rpa_mixed.StepBlocks.unless`)
    fallbacks = set(quick) - set(all_subjects("default", [], True))
    assert all(name.endswith(" does not apply]") for name in fallbacks), fallbacks
    bests = {"jax-flash[blocks 1024]", "jax-flash[blocks 4096/1024]",
             "jax-splash[blocks 1024/1024]", "jax-splash[blocks 2048/2048]", FUSED}  # fmt: skip
    assert bests <= set(quick)
    compiles = sum(
        s.build(w, None) is not None for s in quick.values() for w in quick_sweep() if w.chips == 1
    )
    # jax-flash 2 x 4 + 2 (4096/1024), jax-splash 4 + 3 (2048/2048) + 1, jax-paged 1 + 2 (the
    # paged serving batches, bfloat16 and int8), jax-ragged-paged 1 + 2 likewise, tokamax-splash 2,
    # and tpu-inference-rpa-v3's quick blocks on the mixed serving step
    assert compiles <= 26
    default = references.reference_subjects("default")
    assert len(default) >= 3 * len(references.reference_subjects("quick"))


@needs_libtpu
def test_the_vmem_limit_admits_blocks_the_default_limit_rejects() -> None:
    """Splash 2048/2048 needs more than the 16 MiB default scoped VMEM: without the option it
    is a row that did not compile (not a crash); with it, it compiles."""
    subject = all_subjects("default", [], True)["jax-splash[blocks 2048/2048]"]
    workload, target = Workload("forward", 2048), TARGETS["v5e-1"]
    row = worker.analyse_row(subject, workload, target, None)
    assert row["compiled"], row["error"]
    default_limit = dataclasses.replace(subject, whole_vmem=False)
    row = worker.analyse_row(default_limit, workload, target, None)
    assert not row["compiled"]
    assert "vmem" in row["error"].lower()


def test_without_tokamax_the_report_says_why(tmp_path, monkeypatch, no_tokamax) -> None:
    assert "tokamax-splash" not in {s.name for s in references.reference_subjects("default")}
    monkeypatch.setattr(runner, "libtpu_version", lambda: None)  # nothing is compiled
    args = ["bench", "--ops", "forward", "--seq-lens", "1024", "--backends", "xla",
            "--no-measure", "--no-fit", "--no-cache", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    why = "tokamax-splash is not compared: tokamax is not installed"
    assert any(note.startswith(why) for note in results["meta"]["notes"])
    assert why in (tmp_path / "report.md").read_text()


def test_a_tokamax_that_fails_to_import_is_a_note(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setitem(sys.modules, "tokamax", None)  # import tokamax raises ImportError
    note = references.reference_notes()[1]
    assert note.startswith(
        "tokamax-splash is not compared: tokamax does not import: ModuleNotFoundError"
    )


@needs_tokamax
def test_tokamax_is_a_reference_with_its_own_blocks_and_wider_ones() -> None:
    tokamax = [s for s in references.reference_subjects("default") if s.name == "tokamax-splash"]
    own = tokamax[0]
    assert own.config == "its own blocks"
    assert len(tokamax) > 1 and all(s.kind == "reference" for s in tokamax)
    assert own.build(Workload("decode", 8192), None) is None
    assert own.build(Workload("forward_backward", 1024), None) is not None
    assert own.build(Workload("forward", 1024, causal=True), None) is not None
    assert not any("tokamax" in note for note in references.reference_notes())


@needs_libtpu
@needs_tokamax
def test_tokamax_s_causal_grid_sized_at_run_time_is_counted(run_row) -> None:
    """Its causal forward runs only the mask's active blocks: of 8 x 8 blocks of 128 at
    N=1024, the 36 on or below the diagonal, for each of 16 heads, read from the program's
    constants."""
    subject = all_subjects("quick", [], True)["tokamax-splash[its own blocks]"]
    row = run_row(subject, Workload("forward", 1024, causal=True))
    assert row["compiled"], row["error"]
    (kernel,) = row["kernels"]
    assert kernel["grid"] == [16, 36] and kernel["steps"] == 16 * 36


@needs_libtpu
@needs_tokamax
def test_tokamax_compiles_for_v5e_as_a_pallas_kernel() -> None:
    subject = all_subjects("quick", [], True)["tokamax-splash[its own blocks]"]
    row = worker.analyse_row(subject, Workload("forward", 1024), TARGETS["v5e-1"], None)
    assert row["compiled"], row["error"]
    assert row["copies"] == []  # the layout swaps around it cancel its own


def test_jax_paged_charges_its_search_for_a_non_empty_sequence_only_past_an_empty_one():
    """jax's paged_attention loops over the sequences after an empty one to find the next of
    non-zero length: no run on a batch without an empty sequence; unknown (None, counted
    once with a note) on one with it, and no such loop with one sequence."""
    from pallas_flash_bench.kernels import paged_reference

    ragged = Workload("decode", 8192, batch=32, q_heads=32, kv_heads=8, lengths=(512, 8192),
                      cache="paged")  # fmt: skip
    assert paged_reference.loop_trips(16, ragged, "paged_attention.1") == (0,)
    assert paged_reference.loop_trips(16, ragged, "fusion.3") is None
    one = Workload("decode", 8192, batch=1, q_heads=32, kv_heads=8)
    assert paged_reference.loop_trips(16, one, "paged_attention.1") is None
    empty = dataclasses.replace(ragged, lengths=(0, 1))  # about half of them empty
    assert min(empty.sequence_lengths) == 0
    assert paged_reference.loop_trips(16, empty, "paged_attention.1") is None
