"""MaxText's serving programs (JetStream-MaxText's reference): the run's tokens/s from each
program's step, and the committed analysis of the configuration it names."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pallas_flash_bench.models import maxtext_serving
from pallas_flash_estimate.program import whole_program
from pallas_flash_estimate.targets import TARGETS


def test_tokens_per_second_charges_each_sequence_one_prefill_and_insert() -> None:
    # 88 sequences, 1024 steps of 20 ms; each prompt 100 ms to prefill and 1 ms to insert
    rate = maxtext_serving.tokens_per_second(88, 1024, 0.020, 0.100, 0.001)
    assert rate == pytest.approx(88 * 1024 / (1024 * 0.020 + 88 * 0.101))
    # no prefill or insert: one token a sequence a step
    assert maxtext_serving.tokens_per_second(88, 1024, 0.020, 0.0, 0.0) == pytest.approx(4400)


def test_the_committed_analysis_is_of_the_configuration_it_names() -> None:
    analysis = maxtext_serving.committed("llama2-7b")
    if analysis is None:
        pytest.skip("no committed MaxText serving analysis")
    ref = maxtext_serving.SERVING["llama2-7b"]
    assert analysis["reference"] == json.loads(json.dumps(dataclasses.asdict(ref)))
    assert analysis["analysis"] == whole_program.ANALYSIS_VERSION, "rerun nox -s maxtext-serving"
    assert analysis["measured_tokens_per_second"] == ref.published_tokens_per_second
    assert analysis["batch"] == ref.batch_per_chip * TARGETS[ref.topology].chips == 88
    assert set(analysis["programs"]) == set(maxtext_serving.PROGRAMS)
    for end, rate in analysis["tokens_per_second"].items():
        seconds = [analysis["programs"][p]["estimate"][f"step_seconds_{end}"]
                   for p in maxtext_serving.PROGRAMS]  # fmt: skip
        expected = maxtext_serving.tokens_per_second(
            analysis["batch"], ref.generate_length, *seconds
        )  # fmt: skip
        assert rate == pytest.approx(expected)
    assert all(0 < rate < 1e6 for rate in analysis["tokens_per_second"].values())
