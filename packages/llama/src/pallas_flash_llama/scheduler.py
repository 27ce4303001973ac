"""Continuous batching on the host: which tokens of which requests the next step computes.

The serving engine's step runs a flat batch of new tokens from many sequences at once (a
decoding sequence's one token, a prefill chunk of another's prompt), each sequence in a row
(``slot``) of the paged cache. `Scheduler` decides each step's batch and nothing else: it
holds no array and calls no model.

- **Requests** wait in arrival order (`Scheduler.add`). A step first gives every running
  sequence its work, oldest first: one token to a decoding sequence, the next chunk to one
  whose prompt is not yet all in the cache. It then admits waiting requests into free slots
  while the step's ``token_budget`` lasts, their prompts chunked to fit (chunked prefill).
- **Pages.** A sequence in slot ``b`` holds ``ceil(cached / page_size)`` pages, page ``j``
  on shard ``(j + b) % shards`` as `pf.PageAllocator` places it; the scheduler counts each
  shard's free pages as the device allocator does, so a step it plans always gets its pages.
  It never reads the device's allocator back.
- **Preemption.** When a running sequence's next token needs a page no shard has, the most
  recently admitted running sequence is preempted: its pages and slot are freed
  (`StepPlan.released`) and it goes back to the front of the queue with every token it has
  (prompt and generated), to be computed again when it is readmitted (recompute, as vLLM
  does). Its output is the same as if it had never been preempted.
- **Ends.** `Scheduler.commit` takes the tokens the step sampled: a sequence ends at a stop
  token or at ``max_tokens`` generated tokens, and its pages and slot are freed (the next
  plan's ``released``). `Scheduler.cancel` ends a request where it stands, the same way.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import pallas_flash as pf
from pallas_flash_llama.sampling import Sampling

GREEDY = Sampling()

SEEDS = 2**32
"""A request's seed is in ``[0, SEEDS)``."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: ``prompt`` token ids, at most ``max_tokens`` tokens generated, ending early
    at any of ``stop_ids``; the engine samples its tokens by ``sampling`` with ``seed`` (the
    scheduler does not read them)."""

    id: str
    prompt: tuple[int, ...]
    max_tokens: int
    stop_ids: tuple[int, ...] = ()
    sampling: Sampling = GREEDY
    seed: int = 0


@dataclasses.dataclass
class _Sequence:
    request: Request
    tokens: list[int]  # prompt, then every generated token
    slot: int | None = None
    cached: int = 0  # tokens whose K/V the cache holds
    pages: int = 0

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)


@dataclasses.dataclass(frozen=True)
class Work:
    """One sequence's share of a step: ``tokens`` (ids) at positions ``start`` onwards, in
    cache row ``slot``; ``sample``: whether the step samples its next token after them (the
    last chunk of what the sequence has, or a decode token)."""

    request_id: str
    slot: int
    start: int
    tokens: tuple[int, ...]
    sample: bool


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A step: its ``work`` (at most the token budget in all), and the slots whose pages and
    rows the engine frees before it (``released``: sequences that ended at the last commit,
    and those preempted)."""

    work: tuple[Work, ...]
    released: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(len(w.tokens) for w in self.work)


@dataclasses.dataclass(frozen=True)
class Finished:
    """A request that ended: its generated tokens and why (``stop``, ``length`` or
    ``cancelled``)."""

    request_id: str
    tokens: tuple[int, ...]
    reason: str


class Scheduler:
    """Plans each step of continuous batching (module doc).

    Args:
      slots: rows of the cache (sequences running at once).
      token_budget: the most new tokens one step computes.
      page_size: positions per page.
      num_pages: pages in the pool.
      pages_per_sequence: the most pages one sequence may hold (its longest length / page).
      shards: parts the pool is split into along its pages (`pf.PageAllocator`).
    """

    def __init__(self, *, slots: int, token_budget: int, page_size: int, num_pages: int,
                 pages_per_sequence: int, shards: int = 1) -> None:  # fmt: skip
        for name, value in (("slots", slots), ("token_budget", token_budget),
                            ("page_size", page_size), ("pages_per_sequence", pages_per_sequence),
                            ("shards", shards)):  # fmt: skip
            if value < 1:
                raise pf.InvalidInputError(f"{name}: expected a positive int, got {value}")
        if num_pages % shards or num_pages < shards:
            raise pf.InvalidInputError(
                f"num_pages: expected a positive multiple of the {shards} shards, got {num_pages}"
            )
        if math.ceil(pages_per_sequence / shards) > num_pages // shards:
            raise pf.InvalidInputError(
                f"num_pages: {num_pages} pages over {shards} shards cannot hold one sequence of "
                f"{pages_per_sequence} pages"
            )
        self.slots, self.token_budget, self.page_size = slots, token_budget, page_size
        self.pages_per_sequence, self.shards = pages_per_sequence, shards
        self.free_pages = [num_pages // shards] * shards
        self._free_slots = list(range(slots))
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []  # in admission order
        self._ids: set[str] = set()
        self._freed: list[int] = []  # slots of requests that ended, for the next plan
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
        """Ends ``request_id`` where it stands: a running sequence's pages and slot are freed
        (the next plan's ``released``). Call it between a commit and the next plan, not for a
        request of a plan not yet committed.

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
            self._freed.append(self._release(seq))
        else:
            self._waiting.remove(seq)
        self._ids.discard(request_id)
        return Finished(request_id, tuple(seq.tokens[len(seq.request.prompt) :]), "cancelled")

    @property
    def idle(self) -> bool:
        """Whether nothing is queued or running."""
        return not self._waiting and not self._running

    def _page_shards(self, seq: _Sequence, length: int) -> collections.Counter:
        """Per shard, the pages ``seq`` needs beyond its own to cache ``length`` tokens."""
        wanted = math.ceil(length / self.page_size)
        return collections.Counter((j + seq.slot) % self.shards for j in range(seq.pages, wanted))

    def _fits(self, need: collections.Counter) -> bool:
        return all(self.free_pages[s] >= n for s, n in need.items())

    def _take(self, seq: _Sequence, need: collections.Counter) -> None:
        for s, n in need.items():
            self.free_pages[s] -= n
        seq.pages += sum(need.values())

    def _release(self, seq: _Sequence) -> int:
        """Frees ``seq``'s pages and slot; returns the slot."""
        slot = seq.slot
        for j in range(seq.pages):
            self.free_pages[(j + slot) % self.shards] += 1
        seq.pages, seq.cached, seq.slot = 0, 0, None
        self._free_slots.append(slot)
        self._free_slots.sort()
        return slot

    def _chunk(self, seq: _Sequence, budget: int) -> Work | None:
        """The next work of ``seq`` within ``budget`` tokens, its pages taken; None where
        none of it fits."""
        remaining = len(seq.tokens) - seq.cached
        count = min(remaining, budget)
        while count > 0:
            need = self._page_shards(seq, seq.cached + count)
            if self._fits(need):
                self._take(seq, need)
                work = Work(seq.request.id, seq.slot, seq.cached,
                            tuple(seq.tokens[seq.cached:seq.cached + count]),
                            sample=count == remaining)  # fmt: skip
                seq.cached += count
                return work
            last_page_start = (seq.cached + count - 1) // self.page_size * self.page_size
            count = last_page_start - seq.cached  # one page fewer
        return None

    def schedule(self) -> StepPlan:
        """The next step's plan (module doc)."""
        work: list[Work] = []
        released, self._freed = self._freed, []
        budget = self.token_budget
        index = 0
        while index < len(self._running) and budget > 0:
            seq = self._running[index]
            found = self._chunk(seq, budget)
            if found is None:  # no page for it: preempt the newest running sequence
                victim = self._running.pop()  # it has no work in this step yet
                self.preemptions += 1
                released.append(self._release(victim))
                self._waiting.appendleft(victim)  # recomputed from its tokens when readmitted
                continue  # the same sequence again, unless it was the victim
            work.append(found)
            budget -= len(found.tokens)
            index += 1
        while self._waiting and self._free_slots and budget > 0:
            seq = self._waiting[0]
            seq.slot = self._free_slots[0]
            found = self._chunk(seq, budget)
            if found is None:
                seq.slot = None
                break
            self._free_slots.pop(0)
            self._waiting.popleft()
            self._running.append(seq)
            work.append(found)
            budget -= len(found.tokens)
        return StepPlan(tuple(work), tuple(released))

    def commit(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[Finished]:
        """Records the tokens a step sampled (``sampled``: request id to token, for each work
        of ``plan`` with ``sample``); returns the requests that ended, whose pages and slots
        are freed (the next plan releases them).

        Raises:
          pf.InvalidInputError: ``sampled`` lacks a token the plan samples.
        """
        running = {seq.request.id: seq for seq in self._running}
        finished = []
        for item in plan.work:
            if not item.sample:
                continue
            if item.request_id not in sampled:
                raise pf.InvalidInputError(f"sampled: no token for request {item.request_id!r}")
            seq = running[item.request_id]
            token = int(sampled[item.request_id])
            seq.tokens.append(token)
            reason = None
            if token in seq.request.stop_ids:
                reason = "stop"
            elif seq.generated >= seq.request.max_tokens:
                reason = "length"
            if reason is not None:
                self._running.remove(seq)
                self._freed.append(self._release(seq))
                self._ids.discard(seq.request.id)
                generated = tuple(seq.tokens[len(seq.request.prompt) :])
                finished.append(Finished(seq.request.id, generated, reason))
        return finished


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
