"""Continuous batching's plans (`scheduler`): a request's tokens are the same served alone
or among others arriving at random steps, under preemption too; the token budget holds; no
page or slot is leaked. The model is a stand-in whose next token depends on every token
before it, so a wrong or missing token anywhere changes what follows."""

from __future__ import annotations

import random

import pytest

import pallas_flash as pf
from pallas_flash_llama.scheduler import Finished, Request, Scheduler, StepPlan, serve_all

VOCAB = 1000


def _next_token(tokens: list[int]) -> int:
    value = 17
    for token in tokens:
        value = (value * 31 + token) % 1_000_003
    return value % VOCAB


class StandIn:
    """The step a model would run: it empties the rows a plan releases, checks that each work
    starts where its row's cache ends, and samples `_next_token` of the row."""

    def __init__(self, scheduler: Scheduler, stop: int | None = None) -> None:
        self.scheduler, self.rows, self.plans = scheduler, {}, []
        self.stop = stop

    def __call__(self, plan: StepPlan) -> dict[str, int]:
        self.plans.append(plan)
        for slot in plan.released:
            self.rows.pop(slot, None)
        sampled = {}
        for work in plan.work:
            row = self.rows.setdefault(work.slot, [])
            assert work.start == len(row), "work starts where the row's cache ends"
            row.extend(work.tokens)
            if work.sample:
                sampled[work.request_id] = _next_token(row)
        return sampled


def _requests(count: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"r{i}", tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))),
                    max_tokens=rng.randint(1, 24)) for i in range(count)]  # fmt: skip


def _alone(request: Request) -> tuple[int, ...]:
    tokens = list(request.prompt)
    for _ in range(request.max_tokens):
        tokens.append(_next_token(tokens))
    return tuple(tokens[len(request.prompt) :])


def _scheduler(num_pages: int, shards: int = 1) -> Scheduler:
    return Scheduler(slots=4, token_budget=16, page_size=4, num_pages=num_pages,
                     pages_per_sequence=16, shards=shards)  # fmt: skip


@pytest.mark.parametrize(("num_pages", "shards"), [(64, 1), (16, 1), (16, 2)])
def test_each_request_gets_the_tokens_it_gets_alone(num_pages: int, shards: int) -> None:
    """64 pages hold every slot's longest sequence; 16 do not, so sequences are preempted
    and computed again."""
    scheduler = _scheduler(num_pages, shards)
    model = StandIn(scheduler)
    requests = _requests(24, seed=num_pages + shards)
    pending, arrivals = list(requests), random.Random(7)
    done = {}
    while pending or not scheduler.idle:
        for _ in range(arrivals.randint(0, 3)):  # requests arrive at random steps
            if pending:
                scheduler.add(pending.pop(0))
        if scheduler.idle:
            continue
        plan = scheduler.schedule()
        assert plan.work and plan.tokens <= scheduler.token_budget
        assert len({w.slot for w in plan.work}) == len(plan.work), "one work per row"
        assert min(scheduler.free_pages) >= 0, "never more pages than the pool holds"
        done.update((f.request_id, f) for f in scheduler.commit(plan, model(plan)))
    assert {r.id: done[r.id].tokens for r in requests} == {r.id: _alone(r) for r in requests}
    assert all(f.reason == "length" for f in done.values())
    assert scheduler.free_pages == [num_pages // shards] * shards, "no page leaked"
    assert (scheduler.preemptions > 0) == (num_pages == 16)


def test_a_long_prompt_is_prefilled_in_chunks_beside_decoding() -> None:
    scheduler = _scheduler(64)
    model = StandIn(scheduler)
    short, long = Request("short", (5,), max_tokens=8), Request("long", tuple(range(40)), 2)
    done = serve_all(scheduler, [short, long], model)
    first = model.plans[0]
    assert [(w.request_id, len(w.tokens), w.sample) for w in first.work] == [
        ("short", 1, True), ("long", 15, False)]  # fmt: skip
    second = model.plans[1]
    assert [(w.request_id, len(w.tokens)) for w in second.work] == [("short", 1), ("long", 15)]
    assert done["long"].tokens == _alone(long) and done["short"].tokens == _alone(short)


def test_a_stop_token_ends_a_request() -> None:
    request = Request("r", (1, 2, 3), max_tokens=10)
    stop = _alone(request)[2]
    scheduler = _scheduler(64)
    done = serve_all(scheduler, [Request("r", (1, 2, 3), 10, stop_ids=(stop,))],
                     StandIn(scheduler))  # fmt: skip
    assert done["r"].tokens == _alone(request)[:3] and done["r"].reason == "stop"
    assert scheduler.free_pages == [64]


def test_bad_requests_and_pools_are_refused() -> None:
    scheduler = _scheduler(64)
    with pytest.raises(pf.InvalidInputError, match="prompt: expected at least one token"):
        scheduler.add(Request("a", (), 4))
    with pytest.raises(pf.InvalidInputError, match="max_tokens: expected >= 1"):
        scheduler.add(Request("a", (1,), 0))
    with pytest.raises(pf.InvalidInputError, match="exceed the 64 positions"):
        scheduler.add(Request("a", tuple(range(60)), 5))
    scheduler.add(Request("a", (1,), 1))
    with pytest.raises(pf.InvalidInputError, match="id: 'a' is already queued"):
        scheduler.add(Request("a", (1,), 1))
    with pytest.raises(pf.InvalidInputError, match="num_pages: 8 pages over 1 shards cannot"):
        Scheduler(slots=1, token_budget=8, page_size=4, num_pages=8, pages_per_sequence=16)
    with pytest.raises(pf.InvalidInputError, match="token_budget: expected a positive int"):
        Scheduler(slots=1, token_budget=0, page_size=4, num_pages=8, pages_per_sequence=2)


def test_cancel_ends_a_request_where_it_stands_and_frees_its_pages() -> None:
    scheduler = _scheduler(64)
    model = StandIn(scheduler)
    running, queued = Request("running", tuple(range(10)), 8), Request("queued", (1,), 4)
    scheduler.add(running)
    for _ in range(2):  # its prompt and first token, then its second token
        plan = scheduler.schedule()
        scheduler.commit(plan, model(plan))
    scheduler.add(queued)
    assert scheduler.cancel("running") == Finished("running", _alone(running)[:2], "cancelled")
    assert scheduler.cancel("running") is None and scheduler.cancel("unknown") is None
    plan = scheduler.schedule()
    assert plan.released == (0,) and [w.request_id for w in plan.work] == ["queued"]
    assert scheduler.cancel("queued") == Finished("queued", (), "cancelled")
    assert scheduler.schedule().released == (0,)
    assert scheduler.idle and scheduler.free_pages == [64], "no page leaked"
    scheduler.add(queued)  # its id is free again
    assert scheduler.cancel("queued") == Finished("queued", (), "cancelled")
