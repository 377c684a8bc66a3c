"""`ApiMetrics`: the API process's own Prometheus metrics (`GET /metrics`, with the metering metrics):
responses by route and status, admission time (request received -> job written), the time spent
tokenizing prompts (its `_count` is how many prompts were tokenized: a request refused at admission
adds none), admission refusals by reason, the requests waiting on their jobs' tokens (api/threads.py:
those holding a waiting thread, and those queued for one once all `max_waiting_requests` are taken), the jobs
streamed now, and whether the process drains (api/shutdown.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TOKENIZE_BUCKETS_S = (0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0)


class ApiMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.responses = Counter(
            "prfaas_api_responses", "HTTP responses by route and status", ["route", "status"], registry=registry
        )
        self.tokenize_s = Histogram(
            "prfaas_api_tokenize_seconds", "time to tokenize one prompt", buckets=TOKENIZE_BUCKETS_S, registry=registry
        )
        self.admission_s = Histogram(
            "prfaas_api_admission_seconds", "request received -> job written (admit, tokenize, place, write)",
            ["kind"], buckets=TOKENIZE_BUCKETS_S, registry=registry,
        )  # fmt: skip
        self.refused = Counter(
            "prfaas_api_admission_refused", "requests refused at admission, by reason", ["reason"], registry=registry
        )
        self.waiting = Gauge(
            "prfaas_api_waiting_requests", "requests holding a thread while they wait on their jobs' tokens",
            registry=registry,
        )  # fmt: skip
        self.waiting_queued = Gauge(
            "prfaas_api_waiting_queued", "requests queued for a waiting thread (all max_waiting_requests taken)",
            registry=registry,
        )  # fmt: skip

        self.streaming = Gauge(
            "prfaas_api_jobs_streaming", "jobs this process streams to their clients now", registry=registry
        )
        self.draining = Gauge(
            "prfaas_api_draining", "1 from SIGTERM on: this process drains (api/shutdown.py)", registry=registry
        )

    def watch_drain(self, streaming: Callable[[], int], draining: Callable[[], bool]) -> None:
        """Read the follower's streamed jobs and the drain's state at each scrape."""
        self.streaming.set_function(lambda: float(streaming()))
        self.draining.set_function(lambda: float(draining()))

    def watch_waiting(self, limiter: Any) -> None:
        """Read the waiting threads' limiter (an anyio CapacityLimiter) at each scrape: reading its counts from the
        scrape's thread takes no lock of the event loop's, and a stale count is harmless."""
        self.waiting.set_function(lambda: float(limiter.borrowed_tokens))
        self.waiting_queued.set_function(lambda: float(limiter.statistics().tasks_waiting))

    def tokenize(self, encode: Callable[[], list[int]]) -> list[int]:
        """`encode()`, timed."""
        started = time.perf_counter()
        try:
            return encode()
        finally:
            self.tokenize_s.observe(time.perf_counter() - started)
