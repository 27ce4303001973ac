"""Continuous batching on the host: which tokens of which requests the next step computes,
and in which pages of the cache.

The serving engine's step runs a flat batch of new tokens from many sequences at once (a
decoding sequence's one token, a prefill chunk of another's prompt), each sequence in a row
(``slot``) of the paged cache. `Scheduler` decides each step's batch and each sequence's
pages, and nothing else: it holds no array and calls no model.

- **Requests** wait in arrival order (`Scheduler.add`). A step first gives every running
  sequence its work, oldest first: one token to a decoding sequence, the next chunk to one
  whose prompt is not yet all in the cache. It then admits waiting requests into free slots
  while the step's ``token_budget`` lasts, their prompts chunked to fit (chunked prefill).
- **Pages.** A sequence holds the ``ceil(cached / page_size)`` pages its cached tokens take,
  from the scheduler's `page_pool.PagePool`; each `Work` carries the sequence's page ids, the
  row of the page table the step reads.
- **Prefix caching** (``prefix_caching``, on by default). Once a step has computed a full
  page of a sequence, the pool keys it by its tokens and those before it. A request admitted
  later whose first pages have cached keys takes those pages and starts computing after
  them; its last token is always computed (its logits are sampled). `Finished.cached_tokens`
  says how many prompt tokens came from the cache at the request's first admission.
- **Preemption.** When a running sequence's next token needs a page the pool lacks, the most
  recently admitted running sequence is preempted: its pages (cached ones stay cached) and
  slot are freed and it goes back to the front of the queue with every token it has (prompt
  and generated), to be computed again when it is readmitted (recompute, as vLLM does; its
  own cached pages are then matched first). Its output is the same as if it had never been
  preempted.
- **Ends.** `Scheduler.commit` takes the tokens the step sampled: a sequence ends at a stop
  token or at ``max_tokens`` generated tokens, and its pages and slot are freed.
  `Scheduler.cancel` ends a request where it stands, the same way.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import pallas_flash as pf
from pallas_flash_llama.logit_processing import LogitProcessing
from pallas_flash_llama.logprobs import TokenLogprob
from pallas_flash_llama.page_pool import ROOT, PagePool, page_keys
from pallas_flash_llama.sampling import Sampling

GREEDY = Sampling()

SEEDS = 2**32
"""A request's seed is in ``[0, SEEDS)``."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: ``prompt`` token ids, at most ``max_tokens`` tokens generated, ending early
    at any of ``stop_ids``; the engine samples its tokens by ``sampling`` with ``seed``, its
    logits edited first by ``processing`` (`logit_processing`), and,
    where they are not None, scores each generated token with ``logprobs`` alternatives and
    each prompt token after the first with ``prompt_logprobs`` (`logprobs`; the scheduler
    reads only ``prompt_logprobs``: such a request computes its whole prompt, no prefix
    taken from the cache)."""

    id: str
    prompt: tuple[int, ...]
    max_tokens: int
    stop_ids: tuple[int, ...] = ()
    sampling: Sampling = GREEDY
    seed: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    processing: LogitProcessing | None = None


@dataclasses.dataclass
class _Sequence:
    request: Request
    tokens: list[int]  # prompt, then every generated token
    slot: int | None = None
    cached: int = 0  # tokens whose K/V the cache holds
    pages: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)  # of its pages cached so far
    cached_prompt: int | None = None  # prompt tokens found cached at its first admission

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)


@dataclasses.dataclass(frozen=True)
class Work:
    """One sequence's share of a step: ``tokens`` (ids) at positions ``start`` onwards, in
    cache row ``slot`` whose pages are ``pages`` (page ``j`` holds positions ``[j, j + 1) x
    page_size``, every one the sequence has once the step ran); ``sample``: whether the step
    samples its next token after them (the last chunk of what the sequence has, or a decode
    token)."""

    request_id: str
    slot: int
    start: int
    tokens: tuple[int, ...]
    sample: bool
    pages: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A step: its ``work``, at most the token budget in all."""

    work: tuple[Work, ...]

    @property
    def tokens(self) -> int:
        return sum(len(w.tokens) for w in self.work)


@dataclasses.dataclass(frozen=True)
class Finished:
    """A request that ended: its generated tokens and why (``stop``, ``length`` or
    ``cancelled``); ``cached_tokens``: its prompt tokens found in the prefix cache when it
    was first admitted; ``prompt_logprobs``: with `Request.prompt_logprobs`, each prompt
    token's (None for the first, and for those not computed: a request cancelled first)."""

    request_id: str
    tokens: tuple[int, ...]
    reason: str
    cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """Where the scheduler stands (`Scheduler.stats`): requests running (admitted, holding a
    slot) and waiting, the share of the pool's pages a sequence holds (free cached pages count
    as free, as vLLM's KV-cache usage counts its blocks) and preemptions so far."""

    running: int
    waiting: int
    page_usage: float
    preemptions: int


class Scheduler:
    """Plans each step of continuous batching (module doc).

    Args:
      slots: rows of the cache (sequences running at once).
      token_budget: the most new tokens one step computes.
      page_size: positions per page.
      num_pages: pages in the pool.
      pages_per_sequence: the most pages one sequence may hold (its longest length / page).
      prefix_caching: whether requests reuse the cached pages of the prefixes they share.
    """

    def __init__(self, *, slots: int, token_budget: int, page_size: int, num_pages: int,
                 pages_per_sequence: int, prefix_caching: bool = True) -> None:  # fmt: skip
        for name, value in (("slots", slots), ("token_budget", token_budget),
                            ("page_size", page_size),
                            ("pages_per_sequence", pages_per_sequence)):  # fmt: skip
            if value < 1:
                raise pf.InvalidInputError(f"{name}: expected a positive int, got {value}")
        if pages_per_sequence > num_pages:
            raise pf.InvalidInputError(
                f"num_pages: {num_pages} pages cannot hold one sequence of {pages_per_sequence}"
            )
        self.slots, self.token_budget, self.page_size = slots, token_budget, page_size
        self.pages_per_sequence = pages_per_sequence
        self.pool = PagePool(num_pages, caching=prefix_caching)
        self._free_slots = list(range(slots))
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []  # in admission order
        self._ids: set[str] = set()
        self.preemptions = 0
        """How many times a running sequence was preempted."""

    @property
    def max_len(self) -> int:
        """The longest sequence (prompt and generated tokens) a slot holds."""
        return self.pages_per_sequence * self.page_size

    def add(self, request: Request) -> None:
        """Queues ``request``.

        Raises:
          pf.InvalidInputError: an empty prompt, ``max_tokens`` below 1, a prompt and
            ``max_tokens`` longer than `max_len`, or an id already queued or running.
        """
        if not request.prompt:
            raise pf.InvalidInputError("prompt: expected at least one token, got none")
        if request.max_tokens < 1:
            raise pf.InvalidInputError(f"max_tokens: expected >= 1, got {request.max_tokens}")
        if len(request.prompt) + request.max_tokens > self.max_len:
            raise pf.InvalidInputError(
                f"prompt: {len(request.prompt)} tokens and max_tokens {request.max_tokens} "
                f"exceed the {self.max_len} positions of a sequence"
            )
        if request.id in self._ids:
            raise pf.InvalidInputError(f"id: {request.id!r} is already queued or running")
        self._ids.add(request.id)
        self._waiting.append(_Sequence(request, list(request.prompt)))

    def cancel(self, request_id: str) -> Finished | None:
        """Ends ``request_id`` where it stands: a running sequence's pages and slot are freed.
        Call it between a commit and the next plan, not for a request of a plan not yet
        committed.

        Returns:
          The request with the tokens it has generated and reason ``cancelled``; None where it
          is neither queued nor running (it has ended, or was never added).
        """
        seq = next((s for s in (*self._waiting, *self._running) if s.request.id == request_id),
                   None)  # fmt: skip
        if seq is None:
            return None
        if seq in self._running:
            self._running.remove(seq)
            self._release(seq)
        else:
            self._waiting.remove(seq)
        self._ids.discard(request_id)
        return self._finished(seq, "cancelled")

    def stats(self) -> SchedulerStats:
        """The requests running and waiting, the pages in use and the preemptions so far."""
        used = 1 - self.pool.free / self.pool.num_pages
        return SchedulerStats(len(self._running), len(self._waiting), used, self.preemptions)

    @property
    def idle(self) -> bool:
        """Whether nothing is queued or running."""
        return not self._waiting and not self._running

    def _release(self, seq: _Sequence) -> None:
        """Frees ``seq``'s pages and slot."""
        self._free_slots.append(seq.slot)
        self._free_slots.sort()
        self._drop_pages(seq)

    def _drop_pages(self, seq: _Sequence) -> None:
        """Lets go of ``seq``'s pages (cached ones stay cached); it holds no slot after."""
        self.pool.release(seq.pages)
        seq.pages, seq.keys, seq.cached, seq.slot = [], [], 0, None

    def _match_prefix(self, seq: _Sequence) -> None:
        """Gives an admitted ``seq`` the cached pages of its longest cached prefix, short of
        its last token (which the step computes, to sample after it)."""
        keys = page_keys(seq.tokens[:-1], self.page_size)
        seq.pages = [] if seq.request.prompt_logprobs is not None else self.pool.match(keys)
        seq.keys = keys[: len(seq.pages)]
        seq.cached = len(seq.pages) * self.page_size
        if seq.cached_prompt is None:
            seq.cached_prompt = min(seq.cached, len(seq.request.prompt))

    def _chunk(self, seq: _Sequence, budget: int) -> Work | None:
        """The next work of ``seq`` within ``budget`` tokens, its pages taken; None where
        none of it fits."""
        remaining = len(seq.tokens) - seq.cached
        count = min(remaining, budget)
        while count > 0:
            need = math.ceil((seq.cached + count) / self.page_size) - len(seq.pages)
            if need <= self.pool.free:
                seq.pages += self.pool.take(need)
                work = Work(seq.request.id, seq.slot, seq.cached,
                            tuple(seq.tokens[seq.cached:seq.cached + count]),
                            sample=count == remaining, pages=tuple(seq.pages))  # fmt: skip
                seq.cached += count
                return work
            last_page_start = (seq.cached + count - 1) // self.page_size * self.page_size
            count = last_page_start - seq.cached  # one page fewer
        return None

    def schedule(self) -> StepPlan:
        """The next step's plan (module doc)."""
        work: list[Work] = []
        budget = self.token_budget
        index = 0
        while index < len(self._running) and budget > 0:
            seq = self._running[index]
            found = self._chunk(seq, budget)
            if found is None:  # no page for it: preempt the newest running sequence
                victim = self._running.pop()  # it has no work in this step yet
                self.preemptions += 1
                self._release(victim)
                self._waiting.appendleft(victim)  # recomputed from its tokens when readmitted
                continue  # the same sequence again, unless it was the victim
            work.append(found)
            budget -= len(found.tokens)
            index += 1
        while self._waiting and self._free_slots and budget > 0:
            seq = self._waiting[0]
            seq.slot = self._free_slots[0]
            self._match_prefix(seq)
            found = self._chunk(seq, budget)
            if found is None:
                self._drop_pages(seq)
                break
            self._free_slots.pop(0)
            self._waiting.popleft()
            self._running.append(seq)
            work.append(found)
            budget -= len(found.tokens)
        return StepPlan(tuple(work))

    def commit(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[Finished]:
        """Records the step of ``plan`` as run: the full pages it computed are cached, and
        the tokens it sampled (``sampled``: request id to token, for each work of ``plan``
        with ``sample``) appended; returns the requests that ended, whose pages and slots
        are freed.

        Raises:
          pf.InvalidInputError: ``sampled`` lacks a token the plan samples.
        """
        running = {seq.request.id: seq for seq in self._running}
        finished = []
        for item in plan.work:
            seq = running[item.request_id]
            self._cache_full_pages(seq)
            if not item.sample:
                continue
            if item.request_id not in sampled:
                raise pf.InvalidInputError(f"sampled: no token for request {item.request_id!r}")
            token = int(sampled[item.request_id])
            seq.tokens.append(token)
            reason = None
            if token in seq.request.stop_ids:
                reason = "stop"
            elif seq.generated >= seq.request.max_tokens:
                reason = "length"
            if reason is not None:
                self._running.remove(seq)
                self._release(seq)
                self._ids.discard(seq.request.id)
                finished.append(self._finished(seq, reason))
        return finished

    def _cache_full_pages(self, seq: _Sequence) -> None:
        """Keys the pages of ``seq`` that its computed tokens fill and that are not keyed."""
        full = seq.cached // self.page_size
        done = len(seq.keys)
        if full == done or not self.pool.caching:
            return
        start, parent = done * self.page_size, seq.keys[-1] if seq.keys else ROOT
        for page, key in zip(seq.pages[done:full],
                             page_keys(seq.tokens[start:full * self.page_size], self.page_size,
                                       parent), strict=True):  # fmt: skip
            self.pool.cache(page, key)
            seq.keys.append(key)

    @staticmethod
    def _finished(seq: _Sequence, reason: str) -> Finished:
        generated = tuple(seq.tokens[len(seq.request.prompt) :])
        return Finished(seq.request.id, generated, reason, seq.cached_prompt or 0)


def serve_all(scheduler: Scheduler, requests: Sequence[Request],
              step: Callable[[StepPlan], Mapping[str, int]]) -> dict[str, Finished]:  # fmt: skip
    """Runs ``requests`` to their ends: each plan goes to ``step(plan) -> {id: token}``."""
    for request in requests:
        scheduler.add(request)
    done: dict[str, Finished] = {}
    while not scheduler.idle:
        plan = scheduler.schedule()
        if not plan.work:
            raise RuntimeError("the scheduler planned an empty step with requests pending")
        done.update((f.request_id, f) for f in scheduler.commit(plan, step(plan)))
    return done
