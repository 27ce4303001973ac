# ruff: noqa: E501 - HLO lines are as long as the compiler prints them
"""A conditional's branches weighed by how often each is taken (a context-parallel ring's
pairs of chunks: skipped, diagonal, unmasked), in the counts and in the replay."""

from __future__ import annotations

import pytest

from pallas_flash_estimate.cost import overlap
from pallas_flash_estimate.evaluate import program_loops
from pallas_flash_estimate.read import hlo

# A loop of 4 steps whose body picks one of three branches, as the ring's lax.switch does;
# the diagonal branch also calls a computation of its own; the loop ends with a permute.
RING = """\
HloModule jit_ring

%cond (p.1: (s32[], f32[8])) -> pred[] {
  %bound = s32[] constant(4)
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  ROOT %lt = pred[] compare(%i.1, %bound), direction=LT
}

%skip (s.0: f32[8]) -> f32[8] {
  ROOT %s.0 = f32[8]{0} parameter(0)
}

%mask (m.0: f32[8]) -> f32[8] {
  %m.0 = f32[8]{0} parameter(0)
  ROOT %negate.1 = f32[8]{0} negate(%m.0)
}

%diagonal (d.0: f32[8]) -> f32[8] {
  %d.0 = f32[8]{0} parameter(0)
  %call.1 = f32[8]{0} call(%d.0), to_apply=%mask
  ROOT %kernel.diag = f32[8]{0} custom-call(%call.1), custom_call_target="tpu_custom_call"
}

%unmasked (u.0: f32[8]) -> f32[8] {
  %u.0 = f32[8]{0} parameter(0)
  ROOT %kernel.full = f32[8]{0} custom-call(%u.0), custom_call_target="tpu_custom_call"
}

%body (p.2: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.2 = (s32[], f32[8]{0}) parameter(0)
  %i.2 = s32[] get-tuple-element(%p.2), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i.2, %one)
  %x = f32[8]{0} get-tuple-element(%p.2), index=1
  %case = s32[] remainder(%i.2, %one)
  %pair = f32[8]{0} conditional(%case, %x, %x, %x), branch_computations={%skip, %diagonal, %unmasked}
  %sent = f32[8]{0} collective-permute(%pair), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  ROOT %t.2 = (s32[], f32[8]{0}) tuple(%next, %sent)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %a)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8]{0} get-tuple-element(%loop), index=1
}
"""

ZIGZAG_4 = (7 / 16, 2 / 16, 7 / 16)  # skip, diagonal, unmasked: context_layout.ring_pair_kinds


def _three_branches(op: hlo.HloOp) -> tuple[float, ...]:
    return ZIGZAG_4


def test_without_shares_every_branch_runs_every_time() -> None:
    runs = program_loops.program_runs(RING)
    assert runs.runs("kernel.diag") == 4 and runs.runs("kernel.full") == 4
    assert runs.shares == {}


def test_each_branch_runs_its_share_of_the_conditional_s_runs() -> None:
    runs = program_loops.program_runs(RING, branch_shares=_three_branches)
    assert runs.shares == {"pair": ZIGZAG_4}
    assert runs.runs("kernel.diag") == pytest.approx(4 * 2 / 16)
    assert runs.runs("negate.1") == pytest.approx(4 * 2 / 16)  # through the call too
    assert runs.runs("kernel.full") == pytest.approx(4 * 7 / 16)
    assert runs.runs("sent") == 4  # outside the conditional: every step


def test_shares_that_do_not_match_the_branches_are_refused() -> None:
    with pytest.raises(ValueError, match="branch_shares: expected 3 shares for pair"):
        program_loops.program_runs(RING, branch_shares=lambda op: (0.5, 0.5))


def test_ops_know_the_branch_they_run_under() -> None:
    branches = program_loops.enclosing_branches(hlo.parse_computations(RING))
    assert branches["kernel.diag"] == ("pair", 1)
    assert branches["negate.1"] == ("pair", 1)  # in a computation the branch calls
    assert branches["kernel.full"] == ("pair", 2)
    assert branches["s.0"] == ("pair", 0)
    assert "x" not in branches and "sent" not in branches


def test_the_replay_charges_each_branch_its_share() -> None:
    comps = hlo.parse_computations(RING)
    seconds = {"kernel.diag": 1.0, "kernel.full": 2.0}

    def replay(shares) -> float:
        runs = program_loops.program_runs(RING, comps, shares)
        keys = program_loops.collective_keys(comps, runs)
        return overlap.ScheduleReplay(comps, runs, keys, seconds, {"sent": 0.5}).replay()

    assert replay(None) == pytest.approx(4 * (1.0 + 2.0 + 0.5))
    assert replay(_three_branches) == pytest.approx(4 * (2 / 16 + 2 * 7 / 16 + 0.5))


def test_a_copy_in_a_branch_is_charged_its_share() -> None:
    text = RING.replace(
        '''  ROOT %kernel.full = f32[8]{0} custom-call(%u.0), custom_call_target="tpu_custom_call"''',
        '''  %copy-start.1 = (f32[8]{0}, f32[8]{0}, u32[]) copy-start(%u.0)
  %copy-done.1 = f32[8]{0} copy-done(%copy-start.1)
  ROOT %kernel.full = f32[8]{0} custom-call(%copy-done.1), custom_call_target="tpu_custom_call"''',
    )
    comps = hlo.parse_computations(text)
    runs = program_loops.program_runs(text, comps, _three_branches)
    keys = program_loops.collective_keys(comps, runs)
    replay = overlap.ScheduleReplay(comps, runs, keys, {}, {}, copy_seconds={"copy-start.1": 1.0})
    assert replay.replay() == pytest.approx(4 * 7 / 16)  # nothing to hide it: awaited in full
