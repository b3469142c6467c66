"""The governor's Prometheus metrics, read from its counters at scrape time.

Owns the metric names; imports prometheus_client (only the server loads this
module). One collector per governor, registered in the server's own registry,
so two servers in one process (tests) never share numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from slmguard.governor.leaks import Drift
from slmguard.governor.policy import Level
from slmguard.governor.runtime import Governor
from slmguard.governor.thermal import HeatLevel


class GovernorCollector(Collector):
    def __init__(self, governor: Governor) -> None:
        self.governor = governor

    def collect(self) -> Iterator[Any]:
        g = self.governor
        c = g.counters.snapshot()
        yield _one_hot(
            "slmguard_governor_level", "1 for the governor's current level", Level, g.state.level
        )
        yield _one_hot(
            "slmguard_governor_heat_level", "1 for the governor's current heat level",
            HeatLevel, g.heat.level,
        )  # fmt: skip
        for name, (doc, value) in _gauges(g).items():
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=float(value))
        yield from _counters(c)
        rec = g.recycling
        for name, doc, value in (
            ("slmguard_governor_recycles", "engines recycled for a leak", rec.count),
            ("slmguard_governor_recycles_postponed", "recycles given up because in-flight "
             "requests did not finish in time", rec.postponed),
            ("slmguard_governor_recycles_failed", "recycles whose engine did not come back",
             rec.failed),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=value)


def _gauges(g: Governor) -> dict[str, tuple[str, float | int | None]]:
    """The memory signal and the engine's context: name -> (help, value; None: not known)."""
    snap = g.snapshot
    return {
        "slmguard_governor_working_set_bytes": (
            "cgroup usage minus inactive file pages",
            None if snap is None else snap.working_set_bytes,
        ),
        "slmguard_governor_device_bytes": (
            "the engine's device memory outside its cgroup (0 unless the plan allows some)",
            None if snap is None else snap.device_bytes,
        ),
        "slmguard_governor_limit_bytes": (
            "effective memory limit (smallest of cgroup, budget, plan, available)",
            None if snap is None else snap.limit_bytes,
        ),
        "slmguard_governor_pressure_pct": (
            "working set and device memory (or commit charge under overcommit 2) as percent "
            "of the limit",
            g.pressure_pct,
        ),
        "slmguard_governor_psi_some_avg10_pct": (
            "memory PSI some avg10",
            None if snap is None else snap.psi_some_avg10_pct,
        ),
        "slmguard_governor_n_ctx": ("context size the engine runs with now", g.state.n_ctx),
        "slmguard_governor_parked": (
            "1 while the governor keeps the engine stopped",
            1.0 if g.state.parked else 0.0,
        ),
        "slmguard_governor_sample_interval_seconds": (
            "current adaptive sampling interval",
            g.interval_s,
        ),
        "slmguard_governor_heat_slots": (
            "concurrent generations the heat level admits",
            g.heat.slots(),
        ),
        **_leak_gauges(g),
    }


def _leak_gauges(g: Governor) -> dict[str, tuple[str, float | int | None]]:
    """The leak check's view (governor.recycling): drifts, the bound, per 1,000 requests."""
    rec = g.recycling
    return {
        **_drift_gauges("engine", "its settled baseline and the plan", rec.engine_drift),
        **_drift_gauges("front", "its settled baseline", rec.front_drift),
        "slmguard_governor_drift_bound_bytes": (
            "the drift at which the engine is recycled (a share of the room below shed)",
            rec.bound_bytes,
        ),
    }


def _drift_gauges(
    who: str, beyond: str, drift: Drift | None
) -> dict[str, tuple[str, float | int | None]]:
    """One process's drift (``who``: engine or front) and its growth per 1,000 requests."""
    return {
        f"slmguard_governor_{who}_drift_bytes": (
            f"the {who}'s RssAnon+RssShmem+VmSwap beyond {beyond}",
            None if drift is None else drift.drift_bytes,
        ),
        f"slmguard_governor_{who}_growth_per_1000_requests_bytes": (
            f"the {who}'s private memory growth since its baseline, per 1,000 requests",
            None if drift is None else drift.per_1000_requests_bytes,
        ),
    }


def _one_hot(
    name: str, doc: str, levels: Iterable[Level | HeatLevel], current: Level | HeatLevel
) -> GaugeMetricFamily:
    """One series per level, labelled ``level``: 1 for the current one, 0 for the others."""
    family = GaugeMetricFamily(name, doc, labels=["level"])
    for level in levels:
        family.add_metric([level.label], 1.0 if level is current else 0.0)
    return family


def _counters(c: dict[str, Any]) -> Iterator[CounterMetricFamily]:
    """The counters: transitions, rejections, degradations, failures, freed bytes."""
    transitions = CounterMetricFamily(
        "slmguard_governor_transitions", "level changes", labels=["from_level", "to_level"]
    )
    for key, n in c["transitions"].items():
        a, b = key.split("->")
        transitions.add_metric([a, b], n)
    yield transitions
    for name, doc, label, values in (
        ("slmguard_governor_rejections", "requests refused by reason", "reason",
         c["rejections"]),
        ("slmguard_governor_degradations", "degradation steps by kind", "kind",
         c["degradations"]),
        ("slmguard_governor_action_failures", "actions the engine could not carry out",
         "action", c["failures"]),
    ):  # fmt: skip
        family = CounterMetricFamily(name, doc, labels=[label])
        for key, n in values.items():
            family.add_metric([key], n)
        yield family
    yield CounterMetricFamily(
        "slmguard_governor_freed_bytes",
        "engine memory measured as returned by context shrinks",
        value=c["freed_bytes_measured"],
    )
