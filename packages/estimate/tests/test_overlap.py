# ruff: noqa: E501 - HLO lines are as long as the compiler prints them
"""Replaying a compiled schedule: compute between a collective's start and done hides it."""

from __future__ import annotations

import pytest

from pallas_flash_estimate.cost import overlap
from pallas_flash_estimate.evaluate import program_loops
from pallas_flash_estimate.read import hlo

# A scanned layer in the shape libtpu leaves an FSDP all-gather: an async collective start,
# a matmul between, its done, then an add; after the loop a synchronous all-reduce.
LAYER = """\
HloModule jit_step

%cond (p.1: (s32[], f32[8])) -> pred[] {
  %bound = s32[] constant(4)
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  ROOT %lt = pred[] compare(%i.1, %bound), direction=LT
}

%fused_start (param_0: f32[2]) -> f32[8] {
  %param_0 = f32[2]{0} parameter(0)
  ROOT %all-gather.1 = f32[8]{0} all-gather(%param_0), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}
}

%fused_done (param_0.1: f32[2]) -> f32[8] {
  %param_0.1 = f32[2]{0} parameter(0)
  ROOT %all-gather.2 = f32[8]{0} all-gather(%param_0.1), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}
}

%fused_mm (param_0.2: f32[8]) -> f32[8] {
  %param_0.2 = f32[8]{0} parameter(0)
  ROOT %m = f32[8]{0} multiply(%param_0.2, %param_0.2)
}

%body (p.2: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.2 = (s32[], f32[8]{0}) parameter(0)
  %i.2 = s32[] get-tuple-element(%p.2), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i.2, %one)
  %x = f32[8]{0} get-tuple-element(%p.2), index=1
  %slice = f32[2]{0} slice(%x), slice={[0:2]}
  %async-collective-start.1 = f32[8]{0} fusion(%slice), kind=kCustom, calls=%fused_start
  %mm = f32[8]{0} fusion(%x), kind=kOutput, calls=%fused_mm
  %async-collective-done.1 = f32[8]{0} fusion(%slice), kind=kCustom, calls=%fused_done
  %add.1 = f32[8]{0} add(%async-collective-done.1, %mm)
  ROOT %t.2 = (s32[], f32[8]{0}) tuple(%next, %add.1)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %a)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %out = f32[8]{0} get-tuple-element(%loop), index=1
  ROOT %sum = f32[8]{0} all-reduce(%out), channel_id=9, replica_groups={{0,1,2,3}}, to_apply=%cond
}
"""


def _replay(text: str, op_seconds: dict[str, float], collective_seconds: dict[str, float]) -> float:
    comps = hlo.parse_computations(text)
    runs = program_loops.program_runs(text, comps)
    keys = program_loops.collective_keys(comps, runs)
    return overlap.ScheduleReplay(comps, runs, keys, op_seconds, collective_seconds).replay()


def test_an_async_collective_is_named_by_its_start_a_collective_op_by_itself() -> None:
    comps = hlo.parse_computations(LAYER)
    keys = program_loops.collective_keys(comps, program_loops.program_runs(LAYER, comps))
    assert keys == {"async-collective-start.1": "async-collective-start.1",
                    "async-collective-done.1": "async-collective-start.1", "sum": "sum"}  # fmt: skip


@pytest.mark.parametrize(
    ("gather", "iteration"),
    [(2.0, 4.0), (5.0, 6.0)],  # hidden under the matmul (3 + 1); 2 s of it exposed (5 + 1)
)
def test_compute_between_start_and_done_hides_the_collective(gather, iteration) -> None:
    op_seconds = {"mm": 3.0, "add.1": 1.0}
    step = _replay(LAYER, op_seconds, {"async-collective-start.1": gather, "sum": 1.5})
    assert step == pytest.approx(4 * iteration + 1.5)  # 4 trips, then the all-reduce waits


def test_a_collective_awaited_in_the_next_iteration_is_counted_in_steady_state() -> None:
    # the done before the matmul, the start after it: nothing to hide it under
    text = LAYER.replace(
        """  %async-collective-start.1 = f32[8]{0} fusion(%slice), kind=kCustom, calls=%fused_start
  %mm = f32[8]{0} fusion(%x), kind=kOutput, calls=%fused_mm
  %async-collective-done.1 = f32[8]{0} fusion(%slice), kind=kCustom, calls=%fused_done
""",
        """  %async-collective-done.1 = f32[8]{0} fusion(%slice), kind=kCustom, calls=%fused_done
  %mm = f32[8]{0} fusion(%x), kind=kOutput, calls=%fused_mm
  %async-collective-start.1 = f32[8]{0} fusion(%slice), kind=kCustom, calls=%fused_start
""",
    )
    step = _replay(text, {"mm": 3.0, "add.1": 1.0}, {"async-collective-start.1": 5.0, "sum": 0.0})
    # the first iteration waits for nothing (4 s); each later one waits for the gather the
    # one before started after its matmul (5 s, the add hiding 1 s of it) and then runs the
    # matmul: 8 s; the last gather ends 4 s after the loop, then the all-reduce takes the links
    assert step == pytest.approx(4.0 + 3 * 8.0 + 4.0)


def test_the_replay_lies_between_the_two_ends() -> None:
    op_seconds = {"mm": 3.0, "add.1": 1.0}
    collectives = {"async-collective-start.1": 5.0, "sum": 1.5}
    compute, exchange = 4 * 4.0, 4 * 5.0 + 1.5
    hidden, exposed = max(compute, exchange), compute + exchange
    assert hidden <= _replay(LAYER, op_seconds, collectives) <= exposed


def test_a_collective_in_flight_across_a_loop_keeps_its_own_end() -> None:
    # a gather started before the loop and awaited after it: the loop's 4 x 4 s hide it
    text = LAYER.replace(
        "ENTRY %main",
        """%fused_start.2 (param_0.3: f32[2]) -> f32[8] {
  %param_0.3 = f32[2]{0} parameter(0)
  ROOT %all-gather.3 = f32[8]{0} all-gather(%param_0.3), channel_id=11, replica_groups=[1,4]<=[4], dimensions={0}
}

%fused_done.2 (param_0.4: f32[2]) -> f32[8] {
  %param_0.4 = f32[2]{0} parameter(0)
  ROOT %all-gather.4 = f32[8]{0} all-gather(%param_0.4), channel_id=11, replica_groups=[1,4]<=[4], dimensions={0}
}

ENTRY %main""",
    ).replace(
        "  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body\n",
        "  %head = f32[2]{0} slice(%a), slice={[0:2]}\n"
        "  %async-collective-start.2 = f32[8]{0} fusion(%head), kind=kCustom, calls=%fused_start.2\n"
        "  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body\n"
        "  %async-collective-done.2 = f32[8]{0} fusion(%head), kind=kCustom, calls=%fused_done.2\n",
    )
    # the body without its own gather, so nothing else queues for the links
    text = (
        text.replace(
            "  %async-collective-start.1 = f32[8]{0} fusion(%slice), kind=kCustom, calls=%fused_start\n",
            "",
        )
        .replace(
            "  %async-collective-done.1 = f32[8]{0} fusion(%slice), kind=kCustom, calls=%fused_done\n",
            "  %gathered = f32[8]{0} multiply(%x, %x)\n",
        )
        .replace("add(%async-collective-done.1, %mm)", "add(%gathered, %mm)")
    )
    op_seconds = {"mm": 3.0, "add.1": 1.0}
    for gather, step in ((10.0, 16.0), (20.0, 20.0)):  # hidden by the loop; 4 s exposed
        assert _replay(text, op_seconds, {"async-collective-start.2": gather, "sum": 0.0}) == step


# A weight prefetched into VMEM while a matmul runs, awaited before the op that uses it; a
# second copy started after the matmul and awaited at once; then a synchronous all-reduce.
PREFETCH = """\
HloModule jit_decode

%fused_mm (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %m = f32[8]{0} multiply(%param_0, %param_0)
}

ENTRY %main (a: f32[8], w: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = f32[8]{0} parameter(1)
  %slice-start.1 = ((f32[8]{0}), f32[4]{0:S(1)}, s32[]) slice-start(%w), slice={[0:4]}
  %mm = f32[8]{0} fusion(%a), kind=kOutput, calls=%fused_mm
  %slice-done.1 = f32[4]{0:S(1)} slice-done(%slice-start.1)
  %slice-start.2 = ((f32[8]{0}), f32[4]{0:S(1)}, s32[]) slice-start(%w), slice={[4:8]}
  %slice-done.2 = f32[4]{0:S(1)} slice-done(%slice-start.2)
  %use = f32[8]{0} fusion(%mm), kind=kOutput, calls=%fused_mm
  ROOT %sum = f32[8]{0} all-reduce(%use), channel_id=9, replica_groups={{0,1,2,3}}, to_apply=%fused_mm
}
"""


UNAWAITED = PREFETCH.replace("  %slice-done.1 = f32[4]{0:S(1)} slice-done(%slice-start.1)\n", "")
"""The first copy without its done."""


def _replay_copies(text: str, hbm: dict[str, float], copies: dict[str, float],
                   collective: float) -> float:  # fmt: skip
    comps = hlo.parse_computations(text)
    runs = program_loops.program_runs(text, comps)
    keys = program_loops.collective_keys(comps, runs)
    return overlap.ScheduleReplay(comps, runs, keys, {"mm": 3.0, "use": 1.0},
                                  {"sum": collective}, copies, hbm).replay()  # fmt: skip


@pytest.mark.parametrize(
    ("mm_hbm", "step"),
    [
        (0.5, 3.0 + 1.0 + 1.0),  # 2.5 s of HBM left under the matmul: the 2 s copy hidden
        (2.0, 3.0 + 1.0 + 1.0 + 1.0),  # 1 s left: the done waits 1 s
        (3.0, 3.0 + 2.0 + 1.0 + 1.0),  # a memory-bound matmul leaves none: the copy is serial
    ],
)
def test_a_copy_drains_on_the_hbm_time_the_ops_leave(mm_hbm, step) -> None:
    # the second copy (1 s) has nothing between its start and done: it waits in full
    copies = {"slice-start.1": 2.0, "slice-start.2": 1.0}
    assert _replay_copies(PREFETCH, {"mm": mm_hbm, "use": 1.0}, copies, 0.0) == step


def test_a_copy_never_awaited_drains_under_a_wait() -> None:
    # memory-bound ops leave it no HBM time; the 4 s all-reduce, all of it
    hbm, copies = {"mm": 3.0, "use": 1.0}, {"slice-start.1": 2.0}
    assert _replay_copies(PREFETCH, hbm, copies, 4.0) == pytest.approx(3 + 2 + 1 + 4)
    assert _replay_copies(UNAWAITED, hbm, copies, 4.0) == pytest.approx(3 + 1 + 4)
    assert _replay_copies(UNAWAITED, hbm, copies, 0.0) == pytest.approx(3 + 1 + 2)  # at the end


def test_awaiting_a_copy_waits_for_those_queued_before_it() -> None:
    # first in, first out: the second copy's done (nothing hides it) also finishes the first,
    # which a memory-bound matmul left untouched
    copies = {"slice-start.1": 2.0, "slice-start.2": 1.0}
    step = _replay_copies(UNAWAITED, {"mm": 3.0, "use": 1.0}, copies, 0.0)
    assert step == pytest.approx(3 + (2 + 1) + 1)
