"""Prometheus metrics of one server, in its own ``CollectorRegistry``.

Owns metric names and label sets; no module-level state (two apps in one
process, as in tests, never share counters). Gauges that depend on the worker
(RSS) are sampled when scraped.
"""

from __future__ import annotations

from collections.abc import Callable

STATES = ("loading", "ready", "degraded", "restarting", "failed", "stopped")


class ServeMetrics:
    def __init__(
        self,
        worker_rss: Callable[[], float],
        front_rss: Callable[[], float],
        queue_depth: Callable[[], float],
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "slmguard_requests", "HTTP API requests by endpoint and outcome",
            ["endpoint", "outcome"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "slmguard_prompt_tokens", "prompt tokens processed", registry=r
        )
        self.completion_tokens = Counter(
            "slmguard_completion_tokens", "completion tokens generated", registry=r
        )
        self.ttft = Histogram(
            "slmguard_time_to_first_token_seconds",
            "from request arrival to the first generated text",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.token_latency = Histogram(
            "slmguard_token_latency_seconds",
            "time between consecutive generated pieces of text",
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5),
            registry=r,
        )
        self.worker_restarts = Counter(
            "slmguard_worker_restarts", "engine worker deaths followed by a restart", registry=r
        )
        queue = Gauge("slmguard_queue_depth", "requests waiting for the engine", registry=r)
        queue.set_function(queue_depth)
        wrss = Gauge("slmguard_worker_rss_bytes", "resident memory of the engine worker",
                     registry=r)  # fmt: skip
        wrss.set_function(worker_rss)
        frss = Gauge("slmguard_front_rss_bytes", "resident memory of the API front", registry=r)
        frss.set_function(front_rss)
        self.state = Gauge("slmguard_state", "1 for the current server state", ["state"],
                           registry=r)  # fmt: skip

    def set_state(self, state: str) -> None:
        for s in STATES:
            self.state.labels(state=s).set(1 if s == state else 0)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
