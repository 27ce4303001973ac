"""MaxText's published step: the time its MFU implies, by the flop count it was measured with."""

from __future__ import annotations

import pytest

from pallas_flash_bench.models import maxtext_steps, model_flops


def test_the_published_mfu_implies_a_step_by_the_flop_count_of_its_day() -> None:
    step = maxtext_steps.STEPS["16b"]
    # MaxText's calculate_tflops_training_per_device for this config: 1197.14 TFLOP a chip
    # (weights 1157.55, causal attention halved 39.58)
    assert step.step_flops() == pytest.approx(1197.14e12, rel=1e-5)
    attention = 3 * model_flops.attention_flops(step, step.batch_per_chip, step.seq_len)
    assert step.step_flops(causal_halved=False) == pytest.approx(step.step_flops() + attention)
    # 61.10 % of 197 TFLOP/s over 1236.7 TFLOP (attention not halved): 10.27 s
    assert step.published_step_seconds(197e12) == pytest.approx(10.2746, rel=1e-4)


def test_the_committed_analysis_is_of_the_step_it_names() -> None:
    analysis = maxtext_steps.committed("16b")
    if analysis is None:
        pytest.skip("no committed MaxText analysis")
    step = maxtext_steps.STEPS["16b"]
    assert analysis["step"]["arguments"] == list(step.arguments)
    assert analysis["measured_seconds"] == pytest.approx(step.published_step_seconds(197e12))
    assert analysis["estimate"]["loop_trips"], "the scanned layers' trip count was read"
