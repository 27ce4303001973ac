"""Cache keys: what invalidates a cached compile and what does not."""

from __future__ import annotations

import pytest

from pallas_flash_bench.runs import workers
from pallas_flash_bench.runs.cache import ResultCache

JOB = {"id": 3, "kind": "row", "subject": "jax-flash[blocks 512]", "version": "0.10.2",
       "workload": {"op": "forward", "seq_len": 1024}, "target": "v5e-1", "topology": "v5e:2x2",
       "sweep": "quick",
       "backends": None, "references": True}  # fmt: skip
VERSIONS = {"jax": "0.10.2", "libtpu": "0.0.42.1", "analysis": "2"}


def test_key_ignores_how_the_subject_was_found() -> None:
    other_run = {**JOB, "id": 9, "sweep": "default", "backends": ["xla"]}
    assert ResultCache.key(other_run, VERSIONS) == ResultCache.key(JOB, VERSIONS)


def test_targets_of_one_topology_share_results() -> None:
    assert ResultCache.key({**JOB, "target": "v5e-4"}, VERSIONS) == ResultCache.key(JOB, VERSIONS)


def test_key_changes_with_subject_version_workload_topology_and_toolchain() -> None:
    key = ResultCache.key(JOB, VERSIONS)
    assert ResultCache.key({**JOB, "version": "0.11.0"}, VERSIONS) != key
    assert ResultCache.key({**JOB, "workload": {"op": "forward", "seq_len": 2048}}, VERSIONS) != key
    assert ResultCache.key({**JOB, "target": "v6e", "topology": "v6e:2x2"}, VERSIONS) != key
    assert ResultCache.key(JOB, {**VERSIONS, "libtpu": "0.0.51"}) != key
    assert ResultCache.key(JOB, {**VERSIONS, "analysis": "3"}) != key


def test_round_trip_and_disabled_cache(tmp_path) -> None:
    cache = ResultCache(tmp_path)
    cache.put("abc", {"compiled": True})
    assert cache.get("abc") == {"compiled": True}
    assert cache.get("missing") is None and not cache.holds("missing")
    cache.put("unsupported", None)  # the subject does not support the workload: cached too
    assert cache.holds("unsupported") and cache.get("unsupported") is None
    disabled = ResultCache(None)
    disabled.put("abc", {"compiled": True})
    assert disabled.get("abc") is None and not disabled.holds("abc")


def test_a_whole_program_job_is_keyed_by_the_code_it_compiles(tmp_path, monkeypatch) -> None:
    """A context (or model) job compiles our kernels inside a whole program: its key holds
    the installed backends' sources, so an edited kernel recompiles it."""
    from pallas_flash_bench.context.context_workloads import quick_context
    from pallas_flash_bench.kernels import subjects
    from pallas_flash_bench.runs import runner
    from pallas_flash_estimate.targets import TARGETS

    options = runner.BenchOptions(
        target=TARGETS["v5e-4"], sweep="quick", workloads=[], models=[],
        context=quick_context(), backends=None, references=False, fit=False, measure=False,
        price_per_chip_hour=1.2, out_dir=tmp_path, cache=ResultCache(None), workers=1,
    )  # fmt: skip

    def context_key() -> str:
        (job,) = runner._jobs(options, {})
        assert job["kind"] == "context" and "pallas" in job["code"]
        return ResultCache.key(job, VERSIONS)

    before = context_key()
    assert context_key() == before
    monkeypatch.setattr(subjects, "_sources_digest", lambda package: "edited")
    assert context_key() != before


def test_a_run_stopped_midway_keeps_the_results_it_had(tmp_path, monkeypatch) -> None:
    """Each result is cached as it arrives: a run stopped after its first job (here by an
    interrupt) keeps that job's result; a job error is never cached."""

    jobs = [{**JOB, "id": i, "workload": {"op": "forward", "seq_len": 1024 * (i + 1)}}
            for i in range(3)]  # fmt: skip

    def stopped_after_two(todo, count, progress, on_result):
        on_result(todo[0]["id"], {"compiled": True})
        on_result(todo[1]["id"], {"job_error": "worker exited early"})
        raise KeyboardInterrupt

    monkeypatch.setattr(workers, "run_workers", stopped_after_two)
    cache = ResultCache(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        workers.run_cached(jobs, VERSIONS, cache, 1, "test")
    held = [cache.holds(ResultCache.key(job, VERSIONS)) for job in jobs]
    assert held == [True, False, False]
    assert cache.get(ResultCache.key(jobs[0], VERSIONS)) == {"compiled": True}
