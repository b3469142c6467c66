"""Prometheus metrics of one server, in its own ``CollectorRegistry``.

Owns metric names and label sets; no module-level state (two apps in one
process, as in tests, never share counters). :class:`ServeMetrics` holds the
families, one :class:`ModelMetrics` per served model is what that model's relay,
liveness check and engine count into. A server of one model has no ``model``
label (its series are what they always were); a server of several labels every
series of a model with ``model="<id>"`` (the front's own RSS stays unlabelled).
Three kinds:

- the front's own counters and histograms (requests by outcome, tokens, time
  to first token, token latency, cancellations, engine restarts and stalls);
- gauges sampled when scraped (queue depth, engine and front RSS, state, KV
  cells used and total per slot from the cached ``/slots``, the last measured
  prompt and decode speeds, the engine's last load time);
- the engine's own ``llamacpp:*`` metrics, fetched from llama-server just
  before rendering (:meth:`ServeMetrics.fetch_engine`) and re-exported with
  the label ``engine="llama-server"``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
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
    "unloaded",
)  # fmt: skip
ENGINE_LABEL = "llama-server"
MODEL_LABEL = "model"


class ServeMetrics:
    """The server's metric families; ``labelled`` (several models): each series names its
    model. :meth:`add_model` gives one model's side."""

    def __init__(self, *, labelled: bool = False) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.labelled = labelled
        self.models: list[ModelMetrics] = []
        m = [MODEL_LABEL] if labelled else []
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "slmguard_requests", "HTTP API requests by endpoint and outcome",
            [*m, "endpoint", "outcome"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "slmguard_prompt_tokens", "prompt tokens processed", m, registry=r
        )
        self.completion_tokens = Counter(
            "slmguard_completion_tokens", "completion tokens generated", m, registry=r
        )
        self.ttft = Histogram(
            "slmguard_time_to_first_token_seconds",
            "from request arrival to the first generated text", m,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )  # fmt: skip
        self.token_latency = Histogram(
            "slmguard_token_latency_seconds",
            "time between consecutive streamed chunks", m,
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5),
            registry=r,
        )  # fmt: skip
        self.cancelled = Counter(
            "slmguard_cancelled_generations",
            "generations stopped early (client went away, or aborted by the server)",
            [*m, "reason"],
            registry=r,
        )
        self.engine_restarts = Counter(
            "slmguard_engine_restarts", "engine deaths followed by a restart", m, registry=r
        )
        self.engine_stalls = Counter(
            "slmguard_engine_stalls", "engines killed for making no progress", m, registry=r
        )
        self.request_stalls = Counter(
            "slmguard_request_stalls",
            "requests cancelled alone for making no progress while the engine did", m,
            registry=r,
        )  # fmt: skip
        self.state = Gauge("slmguard_state", "1 for the current server state", [*m, "state"],
                           registry=r)  # fmt: skip
        r.register(_Sampled(self))

    def add_model(
        self, name: str, queue: SlotQueue, engine: EngineProcess, slots: SlotsView
    ) -> ModelMetrics:
        """The series of one served model (the first and only one: unlabelled)."""
        if not self.labelled and self.models:
            raise ValueError("an unlabelled ServeMetrics counts one model")
        model = ModelMetrics(self, name, queue, engine, slots)
        self.models.append(model)
        return model

    async def fetch_engine(self, timeout_s: float = 2.0) -> None:
        """Fetch each ready engine's own metrics for the next render."""
        for model in self.models:
            await model.fetch_engine(timeout_s)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Bound:
    """One model's series of a family (the family itself without the model label):
    ``labels(...)`` takes the family's own labels; ``inc`` and ``observe`` are the
    series' own bound methods (a relayed token costs no extra call)."""

    def __init__(self, family: Any, values: tuple[str, ...], own_labels: bool) -> None:
        self._family = family
        self._values = values
        if not own_labels:
            series = family.labels(*values) if values else family
            self.inc: Callable[..., None] = getattr(series, "inc", _absent)
            self.observe: Callable[[float], None] = getattr(series, "observe", _absent)
            self.set: Callable[[float], None] = getattr(series, "set", _absent)

    def labels(self, *values: str) -> Any:
        return self._family.labels(*self._values, *values)


def _absent(*_: Any) -> None:
    raise TypeError("this metric has no such operation")


class ModelMetrics:
    """What one model counts into (the families' series of its model), and what is
    sampled of it when scraped: its queue, engine and slots."""

    def __init__(
        self,
        families: ServeMetrics,
        name: str,
        queue: SlotQueue,
        engine: EngineProcess,
        slots: SlotsView,
    ) -> None:
        self.name = name
        self.queue = queue
        self.engine = engine
        self.slots = slots
        self.engine_text = ""
        self.prompt_tps: float | None = None
        self.decode_tps: float | None = None
        v = (name,) if families.labelled else ()
        f = families
        self.requests = _Bound(f.requests, v, own_labels=True)
        self.cancelled = _Bound(f.cancelled, v, own_labels=True)
        self.prompt_tokens = _Bound(f.prompt_tokens, v, own_labels=False)
        self.completion_tokens = _Bound(f.completion_tokens, v, own_labels=False)
        self.ttft = _Bound(f.ttft, v, own_labels=False)
        self.token_latency = _Bound(f.token_latency, v, own_labels=False)
        self.engine_restarts = _Bound(f.engine_restarts, v, own_labels=False)
        self.engine_stalls = _Bound(f.engine_stalls, v, own_labels=False)
        self.request_stalls = _Bound(f.request_stalls, v, own_labels=False)
        self._state = _Bound(f.state, v, own_labels=True)
        self.labels = {MODEL_LABEL: name} if families.labelled else {}

    def set_state(self, state: str) -> None:
        for s in STATES:
            self._state.labels(s).set(1 if s == state else 0)

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


class _Sampled:
    """Collector of the gauges computed at scrape time, and the engines' re-exported metrics."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Any]:
        return []  # computed at scrape time: no fixed description

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        models = self.metrics.models
        keys = [MODEL_LABEL] if self.metrics.labelled else []

        def gauge(name: str, doc: str, values: list[tuple[ModelMetrics, Any]]) -> Any:
            family = GaugeMetricFamily(name, doc, labels=keys)
            for m, value in values:
                if value is not None:
                    family.add_metric([m.name] if keys else [], float(value))
            return family

        yield gauge("slmguard_queue_depth", "requests waiting for an engine slot",
                    [(m, m.queue.waiting) for m in models])  # fmt: skip
        yield gauge("slmguard_slots_busy", "engine slots held by requests",
                    [(m, m.queue.busy) for m in models])  # fmt: skip
        yield gauge("slmguard_slots", "engine slots (llama-server -np) now",
                    [(m, m.queue.slots) for m in models])  # fmt: skip
        front = read_status(ROOT, "self")
        if front is not None and front.rss_bytes is not None:
            yield GaugeMetricFamily("slmguard_front_rss_bytes", "resident memory of the API front",
                                    value=float(front.rss_bytes))  # fmt: skip
        yield from _speeds(gauge, models)
        loaded = [(m, m.engine.last_load_s) for m in models if m.engine.last_load_s is not None]
        if loaded:
            yield gauge("slmguard_engine_last_load_seconds", "the engine's last load, from "
                        "its start to serving (what a 503's Retry-After counts on)",
                        loaded)  # fmt: skip
        yield from _engine_memory(gauge, models)
        yield from _kv_cells(keys, models)
        yield from _engine_families([(m.labels, m.engine_text) for m in models])


def _speeds(gauge: Callable[..., Any], models: list[ModelMetrics]) -> Iterator[Any]:
    for name, doc, attr in (
        ("slmguard_prompt_tokens_per_second", "prompt speed of the last long enough prompt",
         "prompt_tps"),
        ("slmguard_decode_tokens_per_second", "decode speed of the last finished generation",
         "decode_tps"),
    ):  # fmt: skip
        values = [(m, getattr(m, attr)) for m in models if getattr(m, attr) is not None]
        if values:
            yield gauge(name, doc, values)


def _engine_memory(gauge: Callable[..., Any], models: list[ModelMetrics]) -> Iterator[Any]:
    """Each running engine's resident memory (an engine not running has none)."""
    status = [(m, read_status(ROOT, m.engine.pid)) for m in models if m.engine.pid]
    running = [(m, s) for m, s in status if s is not None]
    if not running:
        return
    for name, doc, attr in (
        ("slmguard_engine_rss_bytes", "resident memory of the engine", "rss_bytes"),
        ("slmguard_engine_rss_anon_bytes", "anonymous resident memory of the engine",
         "rss_anon_bytes"),
        ("slmguard_engine_rss_file_bytes", "file-backed resident memory of the engine",
         "rss_file_bytes"),
    ):  # fmt: skip
        yield gauge(name, doc, [(m, getattr(s, attr)) for m, s in running])


def _kv_cells(keys: list[str], models: list[ModelMetrics]) -> Iterator[Any]:
    from prometheus_client.core import GaugeMetricFamily

    used = GaugeMetricFamily(
        "slmguard_kv_cells_used", "KV cells holding tokens, per slot", labels=[*keys, "slot"]
    )
    total = GaugeMetricFamily("slmguard_kv_cells_total", "KV cells per slot",
                              labels=[*keys, "slot"])  # fmt: skip
    for m in models:
        named = [m.name] if keys else []
        for slot in m.slots.current():
            used.add_metric([*named, str(slot.id)], slot.kv_cells_used)
            total.add_metric([*named, str(slot.id)], slot.n_ctx)
    yield used
    yield total


def _engine_families(texts: list[tuple[dict[str, str], str]]) -> Iterator[Any]:
    """llama-server's metrics texts as families with the label ``engine`` (and each
    model's labels), one family per name across the engines."""
    from prometheus_client.core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Any] = {}
    for labels, text in texts:
        if not text:
            continue
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError as err:
            log.warning("engine metrics unreadable: %s", err)
            continue
        for fam in families:
            out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            for s in fam.samples:
                out.add_sample(
                    s.name, {**s.labels, **labels, "engine": ENGINE_LABEL}, s.value, s.timestamp
                )
    yield from merged.values()
