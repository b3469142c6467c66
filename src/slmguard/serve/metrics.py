"""Prometheus metrics of one server, in its own ``CollectorRegistry``.

Owns metric names and label sets; no module-level state (two apps in one
process, as in tests, never share counters). Three kinds:

- the front's own counters and histograms (requests by outcome, tokens, time
  to first token, token latency, cancellations, engine restarts and stalls);
- gauges sampled when scraped (queue depth, engine and front RSS, state, KV
  cells used and total per slot from the cached ``/slots``, the last measured
  prompt and decode speeds);
- the engine's own ``llamacpp:*`` metrics, fetched from llama-server just
  before rendering (:meth:`ServeMetrics.fetch_engine`) and re-exported with
  the label ``engine="llama-server"``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from slmguard.errors import EngineUnreachableError
from slmguard.host.process import read_status
from slmguard.host.procfs import ROOT

if TYPE_CHECKING:
    from slmguard.serve.engine import EngineProcess
    from slmguard.serve.queue import SlotQueue
    from slmguard.serve.slots import SlotsView

log = logging.getLogger(__name__)

STATES = (
    "loading", "ready", "degraded", "restarting", "stalled", "parked", "failed", "stopped",
)  # fmt: skip
ENGINE_LABEL = "llama-server"


class ServeMetrics:
    """The server's metrics; the gauges read ``queue``, ``engine`` and ``slots`` when scraped."""

    def __init__(self, queue: SlotQueue, engine: EngineProcess, slots: SlotsView) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.queue = queue
        self.engine = engine
        self.slots = slots
        self.engine_text = ""
        self.prompt_tps: float | None = None
        self.decode_tps: float | None = None
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
            "time between consecutive streamed chunks",
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5),
            registry=r,
        )
        self.cancelled = Counter(
            "slmguard_cancelled_generations",
            "generations stopped early (client went away, or aborted by the server)",
            ["reason"],
            registry=r,
        )
        self.engine_restarts = Counter(
            "slmguard_engine_restarts", "engine deaths followed by a restart", registry=r
        )
        self.engine_stalls = Counter(
            "slmguard_engine_stalls", "engines killed for making no progress", registry=r
        )
        self.request_stalls = Counter(
            "slmguard_request_stalls",
            "requests cancelled alone for making no progress while the engine did",
            registry=r,
        )
        self.state = Gauge("slmguard_state", "1 for the current server state", ["state"],
                           registry=r)  # fmt: skip
        r.register(_Sampled(self))

    def set_state(self, state: str) -> None:
        for s in STATES:
            self.state.labels(state=s).set(1 if s == state else 0)

    def observe_timings(self, timings: Any) -> None:
        """Keep the engine's measured speeds of the last finished request."""
        if not isinstance(timings, dict):
            return
        p, d = timings.get("prompt_per_second"), timings.get("predicted_per_second")
        n_p, n_d = timings.get("prompt_n"), timings.get("predicted_n")
        # One-token prompts (a cache hit) say nothing about prefill speed.
        if isinstance(p, int | float) and isinstance(n_p, int) and n_p >= 8:
            self.prompt_tps = float(p)
        if isinstance(d, int | float) and isinstance(n_d, int) and n_d >= 2:
            self.decode_tps = float(d)

    async def fetch_engine(self, timeout_s: float = 2.0) -> None:
        """Fetch llama-server's own metrics for the next render ('' when it does not answer)."""
        self.engine_text = ""
        if self.engine.state != "ready":
            return
        try:
            status, raw, _ = await self.engine.client.request(
                "GET", "/metrics", timeout_s=timeout_s
            )
        except EngineUnreachableError:
            return
        if status == 200:
            self.engine_text = raw.decode("utf-8", errors="replace")

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Sampled:
    """Collector of the gauges computed at scrape time, and the engine's re-exported metrics."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Any]:
        return []  # computed at scrape time: no fixed description

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        m = self.metrics
        queue = m.queue
        yield GaugeMetricFamily(
            "slmguard_queue_depth", "requests waiting for an engine slot", value=queue.waiting
        )
        yield GaugeMetricFamily(
            "slmguard_slots_busy", "engine slots held by requests", value=queue.busy
        )
        yield GaugeMetricFamily(
            "slmguard_slots", "engine slots (llama-server -np) now", value=queue.slots
        )
        pid = m.engine.pid
        engine = read_status(ROOT, pid) if pid else None
        front = read_status(ROOT, "self")
        values: list[tuple[str, str, float | int | None]] = [
            ("slmguard_front_rss_bytes", "resident memory of the API front",
             front.rss_bytes if front else None),
            ("slmguard_prompt_tokens_per_second", "prompt speed of the last long enough prompt",
             m.prompt_tps),
            ("slmguard_decode_tokens_per_second", "decode speed of the last finished generation",
             m.decode_tps),
        ]  # fmt: skip
        if engine is not None:
            values += [
                ("slmguard_engine_rss_bytes", "resident memory of the engine", engine.rss_bytes),
                ("slmguard_engine_rss_anon_bytes", "anonymous resident memory of the engine",
                 engine.rss_anon_bytes),
                ("slmguard_engine_rss_file_bytes", "file-backed resident memory of the engine",
                 engine.rss_file_bytes),
            ]  # fmt: skip
        for name, doc, value in values:
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=float(value))
        used = GaugeMetricFamily(
            "slmguard_kv_cells_used", "KV cells holding tokens, per slot", labels=["slot"]
        )
        total = GaugeMetricFamily("slmguard_kv_cells_total", "KV cells per slot", labels=["slot"])
        for slot in m.slots.current():
            used.add_metric([str(slot.id)], slot.kv_cells_used)
            total.add_metric([str(slot.id)], slot.n_ctx)
        yield used
        yield total
        yield from _engine_families(m.engine_text)


def _engine_families(text: str) -> Iterator[Any]:
    """llama-server's metrics text as families with the label ``engine``."""
    if not text:
        return
    from prometheus_client.core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as err:
        log.warning("engine metrics unreadable: %s", err)
        return
    for fam in families:
        out = Metric(fam.name, fam.documentation, fam.type)
        for s in fam.samples:
            out.add_sample(s.name, {**s.labels, "engine": ENGINE_LABEL}, s.value, s.timestamp)
        yield out
