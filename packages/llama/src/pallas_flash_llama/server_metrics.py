"""The server's Prometheus metrics (``GET /metrics``) and its one log line per request.

Metric names are vLLM's (``vllm/v1/metrics/loggers.py``), so its dashboards read them, each
labelled with ``model_name``:
- read from the engine at each scrape (`Engine.stats`): ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a fraction, as vLLM's) and
  ``vllm:num_preemptions_total``;
- counted as requests end (`ServingMetrics.finished`): ``vllm:prompt_tokens_total``,
  ``vllm:generation_tokens_total``, ``vllm:request_success_total`` (by ``finished_reason``),
  ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` (prompt tokens
  looked up and found), and the histograms ``vllm:time_to_first_token_seconds``,
  ``vllm:inter_token_latency_seconds`` (vLLM's successor to ``time_per_output_token``: each
  gap between two tokens of a request) and ``vllm:e2e_request_latency_seconds``.

The registry is the app's own, not prometheus_client's global one: two apps in one process
(tests) do not share counts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import prometheus_client
import prometheus_client.core
import prometheus_client.registry

from pallas_flash_llama.scheduler import SchedulerStats

LOG = logging.getLogger("pallas_flash_llama.server")


def log_to_stderr() -> None:
    """Sends the server's log lines (`LOG`, INFO and above) to stderr as uvicorn writes its
    own (``pallas-flash-llama serve``); once."""
    if not LOG.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        LOG.addHandler(handler)
    LOG.setLevel(logging.INFO)


LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
"""Seconds, the histograms' buckets (vLLM's time-to-first-token buckets up to 80 s)."""


@dataclasses.dataclass
class RequestTimes:
    """One choice of a request, timed on the server: when it was submitted, when its first
    token came, and the gaps between its tokens."""

    submitted: float = dataclasses.field(default_factory=time.monotonic)
    first: float | None = None
    last: float | None = None
    gaps: list[float] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Tokens that came."""
        return 0 if self.first is None else len(self.gaps) + 1

    def token(self) -> None:
        """A token came now."""
        now = time.monotonic()
        if self.last is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now


class ServingMetrics:
    """The metrics of one served model (module doc); ``stats`` reads the engine's."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats]) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.model_name = model_name
        labels, registry = ["model_name"], self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> prometheus_client.Counter:
            return prometheus_client.Counter(name, doc, [*labels, *extra], registry=registry)

        def histogram(name: str, doc: str) -> prometheus_client.Histogram:
            return prometheus_client.Histogram(name, doc, labels, registry=registry,
                                               buckets=LATENCY_BUCKETS)  # fmt: skip

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.success = counter("vllm:request_success", "Requests ended.", ("finished_reason",))
        self.cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up.")
        self.cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found cached.")
        self.first_token = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.inter_token = histogram("vllm:inter_token_latency_seconds", "Time between tokens.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency.")
        registry.register(_EngineCollector(model_name, stats))

    def finished(self, request_id: str, prompt: int, cached: int, choices: list[RequestTimes],
                 reasons: list[str | None]) -> None:  # fmt: skip
        """Counts a request that ended (its ``prompt`` tokens once, ``cached`` of them found
        in the prefix cache, and each choice's tokens, times and finish reason: None for one
        cut short, a client gone) and logs it in one line."""
        model, now = self.model_name, time.monotonic()
        reasons = [reason or "abort" for reason in reasons]  # vLLM's label for a request cut
        self.prompt_tokens.labels(model).inc(prompt)
        self.cache_queries.labels(model).inc(prompt)
        self.cache_hits.labels(model).inc(cached)
        for times, reason in zip(choices, reasons, strict=True):
            self.generation_tokens.labels(model).inc(times.tokens)
            self.success.labels(model, reason).inc()
            self.e2e.labels(model).observe(now - times.submitted)
            if times.first is not None:
                self.first_token.labels(model).observe(times.first - times.submitted)
            for gap in times.gaps:
                self.inter_token.labels(model).observe(gap)
        first = choices[0]
        ttft = "-" if first.first is None else f"{first.first - first.submitted:.3f} s"
        generated = sum(c.tokens for c in choices)
        LOG.info("%s: %d prompt tokens (%d cached), %d generated in %d choice(s), first token "
                 "%s, %.3f s, %s", request_id, prompt, cached, generated, len(choices), ttft,
                 now - first.submitted, "/".join(reasons))  # fmt: skip

    def exposition(self) -> bytes:
        """The metrics in Prometheus's text format."""
        return prometheus_client.generate_latest(self.registry)


class _EngineCollector(prometheus_client.registry.Collector):
    """The engine's gauges, read at each scrape."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats]) -> None:
        self.model_name, self.stats = model_name, stats

    def collect(self) -> Iterator[prometheus_client.Metric]:

        stats, labels = self.stats(), ["model_name"]
        families = prometheus_client.core
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests running.", stats.running),
            ("vllm:num_requests_waiting", "Requests waiting.", stats.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 for all of it.", stats.page_usage),
        ):
            gauge = families.GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric([self.model_name], value)
            yield gauge
        preemptions = families.CounterMetricFamily("vllm:num_preemptions", "Preemptions.",
                                                   labels=labels)  # fmt: skip
        preemptions.add_metric([self.model_name], stats.preemptions)
        yield preemptions
