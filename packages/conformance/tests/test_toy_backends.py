"""The suite checks third-party backends: it passes a correct toy and fails a wrong one.

Each test runs ``pytest --pyargs pallas_flash_conformance`` in a subprocess with the toy
backends of ``toy_backends.py`` registered, and reads the outcome of every test from JUnit XML.
"""

from __future__ import annotations

import collections
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).parent


def _run_suite(
    tmp_path: pathlib.Path, backend: str, target: str, *args: str, **env_vars: str
) -> tuple[int, dict[str, str]]:
    """Runs the suite on ``backend`` (extra pytest ``args``, environment variables
    ``env_vars``); returns the exit code and ``{test id: outcome}``."""
    report = tmp_path / "report.xml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        **env_vars,
    }
    env.pop("PALLAS_FLASH_BACKEND", None)
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            target,
            "--backend",
            backend,
            "-p",
            "toy_backends",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            "-o",
            "junit_family=xunit1",
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        module = pathlib.Path(case.get("file")).stem  # xunit1 reports the file, xunit2 does not
        outcomes[f"{module}::{case.get('name')}"] = outcome
    return completed.returncode, outcomes


def test_correct_toy_backend_passes(tmp_path) -> None:
    code, outcomes = _run_suite(tmp_path, "toy", "pallas_flash_conformance")
    counts = collections.Counter(outcomes.values())
    assert code == 0, counts
    assert counts["failure"] == counts["error"] == 0
    assert counts["passed"] > 60, counts
    # Undeclared features were exercised and raised UnsupportedFeatureError, not skipped.
    for feature in ("softcap", "grad", "decode", "gqa", "segment_ids", "bias"):
        test_id = f"test_unsupported::test_undeclared_feature_raises[{feature}]"
        assert outcomes[test_id] == "passed", (feature, outcomes[test_id])
    # Declared features were checked for parity; undeclared ones were skipped.
    assert outcomes["test_attention::test_features[causal-q-long-float32]"] == "passed"
    assert outcomes["test_attention::test_features[softcap-square-float32]"] == "skipped"


def test_wrong_toy_backend_fails(tmp_path) -> None:
    code, outcomes = _run_suite(tmp_path, "toy-unscaled", "pallas_flash_conformance.test_attention")
    failed = {test for test, outcome in outcomes.items() if outcome == "failure"}
    assert code == 1
    assert "test_attention::test_shapes[square-128-float32]" in failed
    assert "test_attention::test_features[causal-square-bfloat16]" in failed


def test_a_race_fails_the_suite_with_the_detector_on(tmp_path) -> None:
    """``toy-racy`` is right but races: it passes, then fails once the detector is on."""
    one_test = ("-k", "test_features and causal-square-float32")
    target = "pallas_flash_conformance.test_attention"
    test_id = "test_attention::test_features[causal-square-float32]"
    code, outcomes = _run_suite(
        tmp_path, "toy-racy", target, *one_test, PALLAS_FLASH_DETECT_RACES="0"
    )
    assert (code, outcomes) == (0, {test_id: "passed"})
    code, outcomes = _run_suite(
        tmp_path, "toy-racy", target, *one_test, PALLAS_FLASH_DETECT_RACES="1"
    )
    assert code == 1
    assert outcomes[test_id] in ("failure", "error"), outcomes
