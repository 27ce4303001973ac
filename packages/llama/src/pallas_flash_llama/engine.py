"""The serving engine: continuous batching (`scheduler`) run on the model (`engine_step`).

`Engine` holds the model's parameters, a paged cache of ``slots`` rows and a `Scheduler`.
Each step the scheduler plans the new tokens (decode tokens and prefill chunks of many
requests, at most ``token_budget``) and the pages they go to (a prompt's cached prefix
reused, `page_pool`), the host lays them out as a `engine_step.StepBatch` padded to the
smallest token bucket that holds them (`engine_step.token_buckets`), and one jitted call
(compiled once per bucket) runs them and samples each finishing slot's next token; the host
reads the sampled tokens back (its only sync), commits them to the scheduler and calls the
requests' callbacks. A background thread (`Engine.start`) steps while there is work and
waits on a condition otherwise; `submit` and `cancel` may be called from any thread,
`run_all` serves a batch synchronously.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_flash as pf
from pallas_flash_llama import sharding
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.engine_step import (
    StepBatch,
    StepExtras,
    bucket_for,
    run_step,
    run_step_with,
    token_buckets,
)
from pallas_flash_llama.generation import inference_params
from pallas_flash_llama.kv_cache import init_cache
from pallas_flash_llama.logit_processing import LogitEdits
from pallas_flash_llama.logprobs import MAX_LOGPROBS, RowLogprobs, TokenLogprob, token_logprob
from pallas_flash_llama.model import Params
from pallas_flash_llama.scheduler import (
    SEEDS,
    Finished,
    Request,
    Scheduler,
    SchedulerStats,
    StepPlan,
    Work,
)


@dataclasses.dataclass
class _Live:
    """A submitted request that has not ended: its callbacks and tokens generated so far."""

    request: Request
    on_token: Callable[[int, TokenLogprob | None], None]
    on_finish: Callable[[Finished], None]
    generated: int = 0
    prompt_logprobs: dict[int, TokenLogprob] = dataclasses.field(default_factory=dict)
    """With ``prompt_logprobs``: each scored prompt token's, by its position."""
    output: Counter[int] = dataclasses.field(default_factory=Counter)
    """Its generated tokens' counts (for its logit processing's penalties)."""

    @functools.cached_property
    def prompt_tokens(self) -> frozenset[int]:
        """The tokens its prompt holds (for its logit processing's repetition penalty)."""
        return frozenset(self.request.prompt)

    @property
    def extra(self) -> bool:
        """Whether its steps score tokens (`logprobs`) or edit its logits
        (`logit_processing`): the step program of its own (`engine_step.run_step_with`)."""
        request = self.request
        asks = (request.logprobs, request.prompt_logprobs, request.processing)
        return any(ask is not None for ask in asks)

    def ended(self, finished: Finished) -> Finished:
        """``finished`` with the prompt's logprobs, where the request asked for them."""
        if self.request.prompt_logprobs is None:
            return finished
        scored = [self.prompt_logprobs.get(p) for p in range(1, len(self.request.prompt))]
        return dataclasses.replace(finished, prompt_logprobs=(None, *scored))


class Engine:
    """Serves requests by continuous batching on one device or a tensor-parallel mesh
    (module doc).

    Args:
      params: the model's parameters (`model.init_params` or `weights.load_params`).
      config: the model.
      slots: sequences running at once (rows of the cache).
      token_budget: the most new tokens per step (the largest of the step's compiled
        sizes, `engine_step.token_buckets`).
      page_size: positions per page.
      num_pages: pages in each layer's pool.
      pages_per_sequence: the most pages one sequence holds (`max_len` / ``page_size``).
      backend: ``pf.ragged_attention``'s backend; default: the registry's choice.
      cache_dtype: the cache's dtype: None for the compute dtype, or ``jnp.int8``.
      mesh: a ``(1, 1, tensor)`` mesh (`sharding.make_mesh`) to serve on: ``params`` placed
        on it (`weights.load_params` with the mesh), the cache's kv heads split over it
        (`engine_step`); None: one device.
      prefix_caching: whether requests reuse the cached pages of the prompt prefixes they
        share (`scheduler`).

    Raises:
      pf.InvalidInputError: a size below 1, a pool that cannot hold one sequence, a bad
        ``cache_dtype``, or a mesh that does not divide the model or whose data or fsdp axis
        is not 1.
    """

    def __init__(self, params: Params, config: LlamaConfig, *, slots: int, token_budget: int,
                 page_size: int, num_pages: int, pages_per_sequence: int,
                 backend: str | None = None, cache_dtype: jax.typing.DTypeLike | None = None,
                 mesh: Mesh | None = None, prefix_caching: bool = True) -> None:  # fmt: skip
        self._scheduler = Scheduler(
            slots=slots, token_budget=token_budget, page_size=page_size, num_pages=num_pages,
            pages_per_sequence=pages_per_sequence, prefix_caching=prefix_caching,
        )  # fmt: skip
        if mesh is not None:
            sharding.check_mesh(config, mesh)
        self.config, self.backend, self.num_pages = config, backend, num_pages
        self.mesh = mesh
        self.buckets = token_buckets(token_budget)
        self._params = inference_params(params, config)
        cache = init_cache(config, slots, self.max_len, mesh, kv_dtype=cache_dtype,
                           page_size=page_size, num_pages=num_pages,
                           split=None if mesh is None else "heads")  # fmt: skip
        # lengths and pages committed beside the pools, as the step returns them: one compile
        beside = cache.k[0].sharding if mesh is None else NamedSharding(mesh, PartitionSpec())
        self._cache = dataclasses.replace(
            cache, lengths=jax.device_put(cache.lengths, beside),
            pages=jax.device_put(cache.pages, beside),
        )  # fmt: skip
        self._lock = threading.Condition()  # the scheduler, _live, _cancels, _stopping
        self._stepping = threading.Lock()  # one step at a time; the cache
        self._live: dict[str, _Live] = {}
        self._cancels: list[str] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def max_len(self) -> int:
        """Positions one sequence holds: its prompt and generated tokens together."""
        return self._scheduler.max_len

    @property
    def preemptions(self) -> int:
        """How many times a running request was preempted (recomputed later)."""
        return self._scheduler.preemptions

    @property
    def free_pages(self) -> int:
        """Pages no running request holds, cached prefixes among them (`num_pages` when
        idle)."""
        with self._lock:
            return self._scheduler.pool.free

    @property
    def cached_pages(self) -> int:
        """Pages that hold a cached prompt prefix."""
        with self._lock:
            return self._scheduler.pool.cached

    def stats(self) -> SchedulerStats:
        """The scheduler's requests running and waiting, pages in use and preemptions."""
        with self._lock:
            return self._scheduler.stats()

    def submit(self, request: Request, on_token: Callable[[int, TokenLogprob | None], None],
               on_finish: Callable[[Finished], None]) -> None:  # fmt: skip
        """Queues ``request``: ``on_token(token, logprob)`` is called for each token it
        generates (the last included; ``logprob`` None unless the request asks for
        ``logprobs``), then ``on_finish`` once, from the thread that steps.

        Raises:
          pf.InvalidInputError: a prompt token outside the vocabulary, a seed outside ``[0,
            2**32)``, ``logprobs`` or ``prompt_logprobs`` outside ``[0, MAX_LOGPROBS]``, or
            what `Scheduler.add` refuses (an empty prompt, ``max_tokens`` below 1 or past
            `max_len`, an id already queued or running).
          RuntimeError: the stepping thread failed (the error is its cause).
        """
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(request, name)
            if count is not None and not 0 <= count <= MAX_LOGPROBS:
                raise pf.InvalidInputError(
                    f"{name}: expected 0 to {MAX_LOGPROBS} alternatives, got {count}"
                )
        bad = [t for t in request.prompt if not 0 <= t < self.config.vocab]
        if bad:
            raise pf.InvalidInputError(
                f"prompt: expected token ids in [0, {self.config.vocab}), got {bad[:5]}"
            )
        if not 0 <= request.seed < SEEDS:
            raise pf.InvalidInputError(f"seed: expected 0 <= seed < 2**32, got {request.seed}")
        with self._lock:
            self._check_alive()
            self._scheduler.add(request)
            self._live[request.id] = _Live(request, on_token, on_finish)
            self._lock.notify_all()

    def cancel(self, request_id: str) -> None:
        """Ends ``request_id`` before its next step: ``on_finish`` gets its tokens so far and
        reason ``cancelled``, its pages and slot are freed. Unknown or ended ids are ignored."""
        with self._lock:
            if request_id in self._live:
                self._cancels.append(request_id)
                self._lock.notify_all()

    def start(self) -> None:
        """Starts the thread that steps while there is work."""
        with self._lock:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stops the thread after its current step (requests left stay queued).

        Raises:
          RuntimeError: the thread's step failed (the error is its cause).
        """
        with self._lock:
            thread, self._stopping = self._thread, True
            self._lock.notify_all()
        if thread is not None:
            thread.join()
        self._thread = None
        self._check_alive()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError("the engine's step failed") from self._error

    def run_all(self, requests: Iterable[Request]) -> dict[str, Finished]:
        """Serves ``requests`` to their ends, on the thread when started, else on this one.

        Raises:
          pf.InvalidInputError: as `submit`, before any is queued past the bad one.
        """
        requests = list(requests)
        done: dict[str, Finished] = {}
        all_done = threading.Event()

        def finish(result: Finished) -> None:
            done[result.request_id] = result
            if len(done) == len(requests):
                all_done.set()

        for request in requests:
            self.submit(request, lambda token, logprob: None, finish)
        while requests and not all_done.is_set():
            if self._thread is None:
                self._step()
            else:
                self._check_alive()
                all_done.wait(0.1)
        return done

    def _has_work(self) -> bool:
        return not self._scheduler.idle or bool(self._cancels)

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self._has_work():
                        self._lock.wait()
                    if self._stopping:
                        return
                self._step()
        except BaseException as error:
            self._error = error
            raise

    def _step(self) -> None:
        """Applies pending cancels, runs the next plan, commits it, then calls back."""
        with self._stepping:
            with self._lock:
                cancelled = [self._scheduler.cancel(i) for i in self._cancels]
                cancelled = [f for f in cancelled if f is not None]
                self._cancels.clear()
                plan = self._scheduler.schedule()
                batch = self._batch(plan)
                scored = [w for w in plan.work if self._live[w.request_id].extra]
                prompt_rows = self._prompt_rows(scored, batch)
                extras = self._extras(scored, batch, prompt_rows) if scored else None
            sampled = np.full(self._scheduler.slots, -1, np.int32)
            found = None
            if extras is not None:
                (sampled, *found), self._cache = run_step_with(
                    self._params, self._cache, batch, extras, self.config, self.backend,
                    self.mesh,
                )  # fmt: skip
                found = jax.device_get(found)
            elif plan.work:
                sampled, self._cache = run_step(
                    self._params, self._cache, batch, self.config, self.backend, self.mesh
                )
            sampled = np.asarray(sampled)
            with self._lock:
                if found is not None and found[1] is not None:
                    self._keep_prompt_logprobs(prompt_rows, found[1])
                tokens = [(w.request_id, int(sampled[w.slot]), w.slot)
                          for w in plan.work if w.sample]  # fmt: skip
                finished = cancelled + self._scheduler.commit(
                    plan, {i: t for i, t, _ in tokens}
                )  # fmt: skip
                calls = []
                for request_id, token, slot in tokens:
                    live = self._live[request_id]
                    count = live.request.logprobs
                    logprob = None if count is None else token_logprob(found[0], slot, token, count)
                    calls.append((live.on_token, (token, logprob)))
                    live.generated += 1
                    live.output[token] += 1
                for f in finished:
                    live = self._live.pop(f.request_id)
                    calls.append((live.on_finish, (live.ended(f),)))
        for call, arguments in calls:
            call(*arguments)

    def _prompt_rows(self, scored: list[Work], batch: StepBatch) -> list[tuple[_Live, int, int]]:
        """``(request, row, position)`` of each of the step's rows whose next token is a
        prompt token at ``position`` that its request asks to score (``prompt_logprobs``)."""
        rows = []
        for item in scored:
            live = self._live[item.request_id]
            if live.request.prompt_logprobs is None:
                continue
            first = int(batch.query_starts[item.slot])
            for i in range(len(item.tokens)):
                if item.start + i + 1 < len(live.request.prompt):
                    rows.append((live, first + i, item.start + i + 1))
        return rows

    def _extras(self, scored: list[Work], batch: StepBatch,
                prompt_rows: list[tuple[_Live, int, int]]) -> StepExtras:  # fmt: skip
        """The step's `StepExtras` for the work ``scored`` of requests that ask for them:
        the prompt tokens to score (at ``prompt_rows``, `_prompt_rows`), and the logit edits
        and sampled tokens to score of the slots that sample."""
        prompts = any(self._live[w.request_id].request.prompt_logprobs is not None
                      for w in scored)  # fmt: skip
        rows = []
        sampled_scored = np.zeros(self._scheduler.slots, bool)
        for item in scored:
            live = self._live[item.request_id]
            request = live.request
            if not item.sample:
                continue
            sampled_scored[item.slot] = request.logprobs is not None
            if request.processing is not None:
                edited = request.processing.tokens_edited(live.prompt_tokens, live.output,
                                                          request.stop_ids)  # fmt: skip
                rows.append((item.slot, request.processing, edited))
        return StepExtras(
            self._next_tokens(prompt_rows, batch) if prompts else None,
            LogitEdits.build(self._scheduler.slots, rows) if rows else None,
            sampled_scored if sampled_scored.any() else None,
        )

    @staticmethod
    def _next_tokens(prompt_rows: list[tuple[_Live, int, int]], batch: StepBatch) -> np.ndarray:
        """``[bucket]`` int32: the prompt token after each row's token that a request scores
        (``prompt_rows``, `_prompt_rows`); -1 elsewhere."""
        next_tokens = np.full(batch.tokens.shape, -1, np.int32)
        for live, row, position in prompt_rows:
            next_tokens[row] = live.request.prompt[position]
        return next_tokens

    @staticmethod
    def _keep_prompt_logprobs(prompt_rows: list[tuple[_Live, int, int]],
                              found: RowLogprobs) -> None:  # fmt: skip
        """Keeps the prompt tokens' logprobs the step scored at ``prompt_rows``, by position
        (a preempted request's recomputed ones overwrite theirs)."""
        for live, row, position in prompt_rows:
            count, token = live.request.prompt_logprobs, live.request.prompt[position]
            live.prompt_logprobs[position] = token_logprob(found, row, token, count)

    def _batch(self, plan: StepPlan) -> StepBatch:
        """``plan`` as the step's inputs (`engine_step.StepBatch`)."""
        bucket = bucket_for(plan.tokens, self.buckets)
        batch = StepBatch.empty(self._scheduler.slots, bucket,
                                self._scheduler.pages_per_sequence)  # fmt: skip
        work = {w.slot: w for w in plan.work}
        start = 0
        for slot in range(self._scheduler.slots):
            batch.query_starts[slot] = start
            if slot in work:
                item, live = work[slot], self._live[work[slot].request_id]
                count = len(item.tokens)
                batch.tokens[start : start + count] = item.tokens
                batch.kv_lengths[slot] = item.start + count
                batch.page_table[slot, : len(item.pages)] = item.pages
                start += count
                if item.sample:
                    batch.sample_rows[slot] = start - 1
                sampling = live.request.sampling
                batch.temperature[slot] = sampling.temperature
                batch.top_k[slot] = sampling.top_k or self.config.vocab
                batch.top_p[slot] = 1.0 if sampling.top_p is None else sampling.top_p
                batch.seeds[slot], batch.counts[slot] = live.request.seed, live.generated
        batch.query_starts[-1] = start
        return batch
