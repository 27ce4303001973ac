"""Continuous batching's plans (`scheduler`): a request's tokens are the same served alone
or among others arriving at random steps, under preemption too, with prefix caching and
without; the token budget holds; no page or slot is leaked. The model is a stand-in that
reads every token back from the pages its plan names, and whose next token depends on every
token before it, so a wrong page or a missing token anywhere changes what follows."""

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
    """The step a model would run on a paged cache: it writes each work's tokens into the
    pages its work names (checking that no page another sequence holds is written), reads the
    sequence back from those pages and samples `_next_token` of it."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler, self.plans = scheduler, []
        self.pages: dict[int, list[int | None]] = {}  # page -> the token at each position

    def __call__(self, plan: StepPlan) -> dict[str, int]:
        self.plans.append(plan)
        size = self.scheduler.page_size
        sampled = {}
        for work in plan.work:
            for i, token in enumerate(work.tokens, start=work.start):
                page = self.pages.setdefault(work.pages[i // size], [None] * size)
                page[i % size] = token
            end = work.start + len(work.tokens)
            row = [self.pages[work.pages[i // size]][i % size] for i in range(end)]
            assert None not in row, "every position before the work's end is in its pages"
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


def _scheduler(num_pages: int, prefix_caching: bool = True) -> Scheduler:
    return Scheduler(slots=4, token_budget=16, page_size=4, num_pages=num_pages,
                     pages_per_sequence=16, prefix_caching=prefix_caching)  # fmt: skip


@pytest.mark.parametrize("caching", [True, False], ids=["prefix caching", "no caching"])
@pytest.mark.parametrize("num_pages", [64, 16])
def test_each_request_gets_the_tokens_it_gets_alone(num_pages: int, caching: bool) -> None:
    """64 pages hold every slot's longest sequence; 16 do not, so sequences are preempted
    and computed again."""
    scheduler = _scheduler(num_pages, caching)
    model = StandIn(scheduler)
    requests = _requests(24, seed=num_pages)
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
        held = [p for w in plan.work for p in w.pages]
        assert len(held) == len(set(held)) or caching, "no page shared without caching"
        done.update((f.request_id, f) for f in scheduler.commit(plan, model(plan)))
    assert {r.id: done[r.id].tokens for r in requests} == {r.id: _alone(r) for r in requests}
    assert all(f.reason == "length" for f in done.values())
    assert scheduler.pool.free == num_pages, "no page leaked: each is free or cached"
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
    assert scheduler.pool.free == 64


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
    with pytest.raises(pf.InvalidInputError, match="num_pages: 8 pages cannot hold one"):
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
    assert scheduler.pool.free == 64, "its pages freed"
    plan = scheduler.schedule()
    assert [(w.request_id, w.slot) for w in plan.work] == [("queued", 0)]
    assert scheduler.cancel("queued") == Finished("queued", (), "cancelled")
    assert scheduler.idle and scheduler.pool.free == 64, "no page leaked"
    scheduler.add(queued)  # its id is free again
    assert scheduler.cancel("queued") == Finished("queued", (), "cancelled")


def _shared_prefix_requests(count: int, seed: int) -> list[Request]:
    """Requests whose prompts start with one of three shared prefixes (4 to 13 tokens, so
    some end mid-page) and go on with a few tokens of their own."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(VOCAB) for _ in range(n)) for n in (4, 9, 13)]
    return [Request(f"r{i}", rng.choice(prefixes) + tuple(rng.randrange(VOCAB)
                                                          for _ in range(rng.randint(0, 6))),
                    max_tokens=rng.randint(1, 12)) for i in range(count)]  # fmt: skip


@pytest.mark.parametrize("num_pages", [64, 16])
def test_shared_prefixes_come_from_the_cache_and_change_no_token(num_pages: int) -> None:
    """Requests sharing prefixes, arriving at random steps: the same tokens as alone, with
    and without the cache (under preemption with 16 pages), and the cache serves some of
    their prompt tokens."""
    requests = _shared_prefix_requests(30, seed=num_pages)
    results = {}
    for caching in (True, False):
        scheduler = _scheduler(num_pages, caching)
        model, pending, arrivals = StandIn(scheduler), list(requests), random.Random(3)
        done = {}
        while pending or not scheduler.idle:
            for _ in range(arrivals.randint(0, 2)):
                if pending:
                    scheduler.add(pending.pop(0))
            if not scheduler.idle:
                plan = scheduler.schedule()
                done.update((f.request_id, f) for f in scheduler.commit(plan, model(plan)))
        assert {r.id: done[r.id].tokens for r in requests} == {r.id: _alone(r) for r in requests}
        assert scheduler.pool.free == num_pages, "no page leaked: each is free or cached"
        results[caching] = sum(f.cached_tokens for f in done.values())
    assert results[True] > 0 and results[False] == 0


def test_a_cached_prefix_is_not_computed_again() -> None:
    """A later prompt sharing three full pages starts after them; a prompt cached whole still
    computes its last token (its page is computed again), to sample after it."""
    scheduler = _scheduler(64)
    model = StandIn(scheduler)
    prefix = tuple(range(100, 112))  # three pages of 4
    first = Request("first", (*prefix, 1, 2), max_tokens=3)
    assert serve_all(scheduler, [first], model)["first"].cached_tokens == 0
    again = Request("again", (*prefix, 7), max_tokens=3)
    done = serve_all(scheduler, [again], model)
    assert model.plans[-3].work[0].start == 12 and done["again"].cached_tokens == 12
    assert done["again"].tokens == _alone(again)
    whole = Request("whole", prefix, max_tokens=2)
    done = serve_all(scheduler, [whole], model)
    assert model.plans[-2].work[0].start == 8 and done["whole"].cached_tokens == 8
    assert done["whole"].tokens == _alone(whole)


def test_without_prefix_caching_nothing_is_cached() -> None:
    scheduler = _scheduler(64, prefix_caching=False)
    model = StandIn(scheduler)
    prompt = tuple(range(100, 112))
    serve_all(scheduler, [Request("a", prompt, 2)], model)
    done = serve_all(scheduler, [Request("b", prompt, 2)], model)
    assert model.plans[-2].work[0].start == 0 and done["b"].cached_tokens == 0
    assert scheduler.pool.cached == 0
