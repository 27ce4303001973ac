"""The serving engine (`engine`): a request's tokens are the same served alone, among others
arriving while it runs, and under preemption, and greedy ones are `generate`'s; sampled
requests follow their own seeds; cancelled and ended requests leave no page held."""

from __future__ import annotations

import random
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from jax.sharding import PartitionSpec
from llama_testing import HANG_S

import pallas_flash as pf
from pallas_flash_llama import engine_step, generation
from pallas_flash_llama.config import get_config
from pallas_flash_llama.engine import Engine
from pallas_flash_llama.logprobs import TokenLogprob
from pallas_flash_llama.model import forward, init_params
from pallas_flash_llama.sampling import Sampling
from pallas_flash_llama.scheduler import GREEDY, Finished, Request
from pallas_flash_llama.sharding import make_mesh, param_shardings

SIZES = {"slots": 3, "token_budget": 8, "page_size": 4, "pages_per_sequence": 8}
"""One step: 8 tokens over 3 slots, so longer prompts are prefilled in chunks; 32 positions
per sequence."""
PAGES, FEW_PAGES = 24, 8
"""Enough pages for every slot's longest sequence, and one sequence's (preemption)."""
SAMPLED = Sampling(temperature=1.0, top_k=100, top_p=0.95)


@pytest.fixture(scope="module")
def tiny():
    config = get_config("tiny").replace(dtype="float32")
    return config, init_params(config, jax.random.key(0))


def _engine(tiny, num_pages: int) -> Engine:
    config, params = tiny
    return Engine(params, config, num_pages=num_pages, backend="xla", **SIZES)


@pytest.fixture(scope="module")
def engine(tiny) -> Engine:
    return _engine(tiny, PAGES)


def _requests(count: int, seed: int, sampling: Sampling = GREEDY) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"r{i}", tuple(rng.randrange(3, 512) for _ in range(rng.randint(3, 14))),
                    max_tokens=rng.randint(4, 10), sampling=sampling, seed=i)
            for i in range(count)]  # fmt: skip


def _tokens(done: dict[str, Finished]) -> dict[str, tuple[int, ...]]:
    return {i: f.tokens for i, f in done.items()}


def _alone(engine: Engine, requests: list[Request]) -> dict[str, tuple[int, ...]]:
    return {r.id: engine.run_all([r])[r.id].tokens for r in requests}


def _generated(tiny, requests: list[Request]) -> dict[str, tuple[int, ...]]:
    """`generation.generate`'s greedy tokens for each request's prompt."""
    config, params = tiny
    longest = max(r.max_tokens for r in requests)
    out = generation.generate_all(params, config, [r.prompt for r in requests],
                                  max_new_tokens=longest, stop_tokens=[], backend="xla",
                                  decode_backend="xla")  # fmt: skip
    return {r.id: tuple(t[: r.max_tokens]) for r, t in zip(requests, out, strict=True)}


def _arriving(engine: Engine, requests: list[Request], seed: int) -> dict[str, Finished]:
    """Serves ``requests`` on the engine's thread, two at first, the others submitted from
    its callbacks at random tokens (and when one ends)."""
    pending, rng = list(requests), random.Random(seed)
    done: dict[str, Finished] = {}
    all_done = threading.Event()

    def submit_next() -> None:
        if pending:
            engine.submit(pending.pop(0), on_token, on_finish)

    def on_token(token: int, logprob: object) -> None:
        if rng.random() < 0.3:
            submit_next()

    def on_finish(result: Finished) -> None:
        done[result.request_id] = result
        submit_next()
        if len(done) == len(requests):
            all_done.set()

    engine.start()
    try:
        submit_next()
        submit_next()
        assert all_done.wait(HANG_S), "every request ends"
    finally:
        engine.stop()
    return done


def test_greedy_tokens_are_the_same_alone_among_arrivals_and_as_generate(tiny, engine) -> None:
    requests = _requests(6, seed=1)
    alone = _alone(engine, requests)
    assert alone == _generated(tiny, requests)
    done = _arriving(engine, requests, seed=2)
    assert _tokens(done) == alone
    assert {f.reason for f in done.values()} == {"length"}
    assert engine.free_pages == PAGES, "no page leaked"


def test_preempted_requests_get_the_same_tokens(tiny, engine) -> None:
    requests = _requests(5, seed=3)
    few = _engine(tiny, FEW_PAGES)
    done = few.run_all(requests)
    assert few.preemptions > 0
    assert _tokens(done) == _alone(engine, requests)
    assert few.free_pages == FEW_PAGES, "no page leaked"


@pytest.mark.parametrize("num_pages", [PAGES, FEW_PAGES])
def test_shared_prefixes_come_from_the_cache_with_the_same_tokens(tiny, num_pages) -> None:
    """Requests sharing a 10-token prefix (two full pages and part of a third), arriving at
    random steps, with pages for every slot or for one sequence: the greedy tokens of an
    engine without the cache, prompt tokens served from the cache, and every page free or
    cached once idle."""
    config, params = tiny
    rng = random.Random(11)
    prefix = tuple(rng.randrange(3, 512) for _ in range(10))
    requests = [Request(f"r{i}", prefix + tuple(rng.randrange(3, 512)
                                                for _ in range(rng.randint(0, 5))),
                        max_tokens=rng.randint(3, 8)) for i in range(6)]  # fmt: skip
    uncached = Engine(params, config, num_pages=num_pages, backend="xla",
                      prefix_caching=False, **SIZES)  # fmt: skip
    expected = uncached.run_all(requests)
    assert uncached.cached_pages == 0 and {f.cached_tokens for f in expected.values()} == {0}
    cached = _engine(tiny, num_pages)
    done = _arriving(cached, requests, seed=num_pages)
    assert _tokens(done) == _tokens(expected)
    assert sum(f.cached_tokens for f in done.values()) >= 8, "at least one prompt's two pages"
    assert cached.free_pages == num_pages and cached.cached_pages > 0


def test_an_int8_cache_serves_the_same_tokens_alone_and_batched(tiny) -> None:
    config, params = tiny
    int8 = Engine(params, config, num_pages=PAGES, backend="xla", cache_dtype=jnp.int8, **SIZES)
    requests = _requests(4, seed=6)
    assert _tokens(int8.run_all(requests)) == _alone(int8, requests)
    assert int8.free_pages == PAGES


@pytest.mark.parametrize("backend", ["xla", "splitkv"])
def test_a_tensor_parallel_engine_serves_the_one_device_tokens(tiny, engine, backend) -> None:
    """Over a (1, 1, 2) mesh of host devices, each holding one of the tiny model's two kv
    heads of every page: the same greedy tokens as one device, batched and under
    preemption, and no page leaked."""
    config, params = tiny
    mesh = make_mesh(1, 1, 2, devices=jax.devices()[:2])
    placed = jax.device_put(params, param_shardings(config, mesh))
    served = Engine(placed, config, num_pages=FEW_PAGES, backend=backend, mesh=mesh, **SIZES)
    assert served._cache.k[0].sharding.spec == PartitionSpec(None, "tensor", None, None)
    requests = _requests(5, seed=3)
    assert _tokens(served.run_all(requests)) == _alone(engine, requests)
    assert served.preemptions > 0
    assert served.free_pages == FEW_PAGES, "no page leaked"


def test_a_bfloat16_engine_s_packed_cache_serves_the_same_tokens_batched(tiny) -> None:
    """A bfloat16 model's paged cache is packed (keys and values in one uint32 pool a layer,
    `pallas_flash.kv_packing`), here split over a (1, 1, 2) mesh's kv heads and read by
    splitkv's ragged kernel: the same greedy tokens batched under preemption as alone, and
    no page leaked."""
    config, params = tiny
    config = config.replace(dtype="bfloat16")
    mesh = make_mesh(1, 1, 2, devices=jax.devices()[:2])
    placed = jax.device_put(params, param_shardings(config, mesh))
    served = Engine(placed, config, num_pages=FEW_PAGES, backend="splitkv", mesh=mesh, **SIZES)
    assert served._cache.packed and served._cache.k[0].dtype == jnp.uint32
    requests = _requests(5, seed=3)
    assert _tokens(served.run_all(requests)) == _alone(served, requests)
    assert served.preemptions > 0
    assert served.free_pages == FEW_PAGES, "no page leaked"


def test_a_mesh_that_splits_the_batch_is_refused(tiny) -> None:
    config, params = tiny
    mesh = make_mesh(1, 2, 2)
    with pytest.raises(pf.InvalidInputError, match="data and fsdp axes are 1"):
        Engine(params, config, num_pages=PAGES, backend="xla", mesh=mesh, **SIZES)


def test_token_buckets_double_up_to_the_budget() -> None:
    assert engine_step.token_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert engine_step.token_buckets(200) == (16, 32, 64, 128, 200)
    assert engine_step.token_buckets(8) == (8,)
    assert [engine_step.bucket_for(n, (16, 32, 64)) for n in (1, 16, 17, 64)] == [16, 16, 32, 64]


def test_each_step_is_padded_to_the_smallest_bucket_that_holds_it(tiny, engine, monkeypatch):
    """With a budget of 48 (buckets 16, 32, 48), the prompts' steps take the larger buckets
    and the decodes' the smallest; the tokens are those of an engine with one bucket."""
    config, params = tiny
    sizes = dict(SIZES, token_budget=48)
    planned = []

    def recording(params, cache, batch, *args):
        planned.append((int(batch.query_starts[-1]), batch.tokens.shape[0]))
        return engine_step.run_step(params, cache, batch, *args)

    requests = [Request(f"p{i}", tuple(range(3, 3 + 20 + i)), max_tokens=6) for i in range(3)]
    alone = _alone(engine, requests)
    monkeypatch.setattr("pallas_flash_llama.engine.run_step", recording)
    bucketed = Engine(params, config, num_pages=PAGES, backend="xla", **sizes)
    assert _tokens(bucketed.run_all(requests)) == alone
    assert planned[0] == (48, 48)  # the prompts' 63 tokens: 48, then 15 with 2 decodes
    assert {bucket for _, bucket in planned} == {16, 32, 48}, planned
    assert all(bucket == engine_step.bucket_for(n, (16, 32, 48)) for n, bucket in planned)


def test_sampled_requests_follow_their_own_seeds(engine) -> None:
    sampled = _requests(3, seed=4, sampling=SAMPLED)
    alone = _alone(engine, sampled)
    mixed = engine.run_all([*sampled, *_requests(6, seed=5)[3:]])
    assert {r.id: mixed[r.id].tokens for r in sampled} == alone
    reseeded = Request("r0", sampled[0].prompt, sampled[0].max_tokens, sampling=SAMPLED, seed=99)
    assert engine.run_all([reseeded])["r0"].tokens != alone["r0"]
    assert engine.free_pages == PAGES


def test_cancel_ends_a_request_and_frees_its_pages(engine) -> None:
    request = Request("long", tuple(range(3, 15)), max_tokens=16)
    full = engine.run_all([request])["long"].tokens
    results: list[Finished] = []
    finished = threading.Event()

    def on_finish(result: Finished) -> None:
        results.append(result)
        finished.set()

    def cancel_running(token: int, logprob: object) -> None:
        engine.cancel("long")  # after its first token: it ends before the next step

    engine.start()
    try:
        engine.submit(request, cancel_running, on_finish)
        assert finished.wait(HANG_S)
    finally:
        engine.stop()
    # its first two pages (of 4 positions) come from the first run's cached prompt
    assert results == [Finished("long", full[:1], "cancelled", cached_tokens=8)]
    assert engine.free_pages == PAGES

    finished.clear()
    engine.submit(request, print, on_finish)  # queued, cancelled before any step
    engine.cancel("long")
    engine.cancel("unknown")  # ignored
    engine.start()
    try:
        assert finished.wait(HANG_S)
    finally:
        engine.stop()
    assert results[1:] == [Finished("long", (), "cancelled")]
    assert engine.free_pages == PAGES


def test_logprobs_are_the_model_s_log_softmax_in_float64(tiny) -> None:
    """A greedy request's generated tokens (3 alternatives each) and its prompt's tokens (2),
    scored in its chunked steps beside a request that asks for none, against float64
    log-softmax of the model's own logits over the whole sequence. Its prompt is computed
    though the cache holds it (a plain run's), and its tokens are the plain run's."""
    config, params = tiny
    engine = _engine(tiny, PAGES)
    prompt = tuple(range(3, 14))  # 11 tokens: prefilled over two steps at a budget of 8
    plain = engine.run_all([Request("plain", prompt, 5)])["plain"]
    generated, finished = [], []
    scored = Request("scored", prompt, 5, logprobs=3, prompt_logprobs=2)
    engine.submit(scored, lambda token, logprob: generated.append(logprob), finished.append)
    beside = engine.run_all([Request("beside", (7, 8, 9), 4)])["beside"]  # stepped together
    while not finished:
        engine._step()
    assert beside.tokens == engine.run_all([Request("again", (7, 8, 9), 4)])["again"].tokens
    (done,) = finished
    assert done.tokens == plain.tokens and done.cached_tokens == 0
    assert [logprob.token for logprob in generated] == list(plain.tokens)

    sequence = jnp.asarray([[*prompt, *plain.tokens]], jnp.int32)
    logits = np.asarray(forward(params, sequence, config, backend="xla")[0], np.float64)
    reference = scipy.special.log_softmax(logits, axis=-1)  # row p scores position p + 1

    def check(logprob: TokenLogprob, position: int, alternatives: int) -> None:
        row = reference[position - 1]
        assert logprob.token == sequence[0, position]
        np.testing.assert_allclose(logprob.logprob, row[logprob.token], atol=1e-4)
        assert logprob.rank == 1 + np.sum(row > row[logprob.token])
        assert [t for t, _ in logprob.top] == list(np.argsort(-row)[:alternatives])
        np.testing.assert_allclose([v for _, v in logprob.top], -np.sort(-row)[:alternatives],
                                   atol=1e-4)  # fmt: skip

    for i, logprob in enumerate(generated):
        check(logprob, len(prompt) + i, 3)
    assert len(done.prompt_logprobs) == len(prompt) and done.prompt_logprobs[0] is None
    for position, logprob in enumerate(done.prompt_logprobs[1:], start=1):
        check(logprob, position, 2)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (Request("a", (), 4), "prompt: expected at least one token"),
        (Request("a", (1, 512), 4), r"prompt: expected token ids in \[0, 512\)"),
        (Request("a", (1,), 40), "exceed the 32 positions"),
        (Request("a", (1,), 4, seed=-1), "seed: expected"),
    ],
)
def test_bad_requests_are_refused_when_submitted(engine, request_, message) -> None:
    with pytest.raises(pf.InvalidInputError, match=message):
        engine.submit(request_, print, print)
