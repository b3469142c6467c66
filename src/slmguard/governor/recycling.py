"""Leak-aware recycling at run time: read the footprints, judge, recycle, keep the evidence.

Owns :class:`Recycling`, the governor's part that reads the engine's and the front's
RssAnon + RssShmem + VmSwap (:mod:`slmguard.host.footprint`) at most every
``min_interval_s``, feeds :mod:`slmguard.governor.leaks`, and, when the engine's drift
crosses the planned bound, asks the server (:class:`Recycler`, which the server's
``EngineControl`` implements) to recycle it: stop admitting to it, let the generations
in flight finish (bounded), restart it, resume. Each recycle is one event
(``governor.recycle``) with its evidence, kept for ``/health``, ``GET /api/v1/governor``,
metrics, ``top`` and ``watch``; a drain that does not finish in time recycles nothing
(``governor.recycle_postponed``) and is tried again after ``retry_s``. The front's drift
is reported (``governor.front_drift``), never acted on: restarting the front would drop
its clients. It never touches a process itself.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from slmguard.governor import events
from slmguard.governor.leaks import (
    Drift,
    EngineView,
    LeakSettings,
    LeakTrack,
    RecycleOutcome,
    Sample,
    drain_growth_bytes,
    drift,
    drift_bound_bytes,
    observe,
    recycle_verdict,
)
from slmguard.governor.signal import MemorySnapshot
from slmguard.host.footprint import read_footprint

log = logging.getLogger(__name__)


class Recycler(Protocol):
    """What recycling needs of the server (part of the governor's ``EngineControl``)."""

    def engine_view(self) -> EngineView | None:
        """The engine's pid, the generations finished and whether it is idle; None while
        it does not serve (loading, restarting, parked)."""

    async def recycle(self, reason: str, drain_timeout_s: float) -> RecycleOutcome:
        """Stop admitting to the engine, let in-flight generations finish within
        ``drain_timeout_s`` (else give up: ``postponed``), restart it, resume."""


class Recycling:
    """One engine's leak track and recycles (and the front's, with ``watch_front``); the
    governor calls :meth:`check` from its tick and :meth:`run` from its actor."""

    def __init__(
        self,
        settings: LeakSettings,
        *,
        use_bytes: int = 0,
        root: Path = Path("/"),
        clock: Callable[[], float] = time.monotonic,
        min_interval_s: float = 0.25,
        watch_front: bool = True,
    ) -> None:
        self.settings = settings
        self.use_bytes = use_bytes  # the plan's memory that grows with use (engine)
        self.root = root
        self.clock = clock
        self.min_interval_s = min_interval_s
        self.watch_front = watch_front  # False: a board's further engine (not the front)
        self.engine_track = LeakTrack()
        self.front_track = LeakTrack()
        self.engine_drift: Drift | None = None
        self.front_drift: Drift | None = None
        self.bound_bytes: int | None = None
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=16)
        self.count = 0
        self.postponed = 0
        self.failed = 0
        self.pending = False
        self.queued_at_verdict = 0  # generations in flight or waiting when it was decided
        self.not_before_s = 0.0
        self._last_check_s: float | None = None
        self._front_reported_bytes = 0

    # ------------------------------------------------------------ judging

    def check(self, snap: MemorySnapshot, shed_pct: float, view: EngineView | None) -> str | None:
        """Sample the front and the engine (when it serves) and judge; the verdict
        ("idle", "drain") when a recycle is due now, else None."""
        now = self.clock()
        if self._last_check_s is not None and now - self._last_check_s < self.min_interval_s:
            return None
        self._last_check_s = now
        s = self.settings
        requests = view.requests if view is not None else None
        front = read_footprint(self.root, os.getpid()) if self.watch_front else None
        if front is not None and requests is not None:
            sample = Sample(os.getpid(), front.private_bytes, requests)
            self.front_track = observe(self.front_track, sample, s)
            self.front_drift = drift(self.front_track, s)
        if view is None:
            return None
        engine = read_footprint(self.root, view.pid)
        if engine is None:
            return None
        self.engine_track = observe(self.engine_track, Sample(view.pid, engine.private_bytes,
                                                              view.requests), s)  # fmt: skip
        self.engine_drift = drift(self.engine_track, s, use_bytes=self.use_bytes)
        d = self.engine_drift
        self.bound_bytes = drift_bound_bytes(
            snap.limit_bytes, shed_pct, snap.used_bytes, d.drift_bytes if d else 0, s
        )
        self._report_front()
        if self.pending or now < self.not_before_s:
            return None
        verdict = recycle_verdict(d, self.bound_bytes, idle=view.idle, settings=s,
                                  queued=view.queued)  # fmt: skip
        if verdict is not None:
            self.pending = True
            self.queued_at_verdict = view.queued
        return verdict

    def _report_front(self) -> None:
        """One warning each time the front's drift reaches the bound, then twice that..."""
        d, bound = self.front_drift, self.bound_bytes
        if d is None or bound is None or not d.spread or d.drift_bytes < bound:
            return
        if d.drift_bytes < 2 * self._front_reported_bytes:
            return
        self._front_reported_bytes = d.drift_bytes
        events.emit("governor.front_drift", logging.WARNING, bound_bytes=bound, **d.as_dict())

    # ------------------------------------------------------------ acting

    async def run(self, engine: Recycler, verdict: str) -> None:
        """Recycle the engine for ``verdict``; the evidence is kept and logged. Raises the
        server's SlmguardError or OSError when the engine did not come back."""
        d, bound = self.engine_drift, self.bound_bytes
        queued = self.queued_at_verdict
        evidence: dict[str, Any] = {
            "verdict": verdict, "bound_bytes": bound, "queued": queued,
            "drain_growth_bytes": drain_growth_bytes(d, queued) if d is not None else 0,
            **(d.as_dict() if d is not None else {}),
        }  # fmt: skip
        reason = (
            f"the engine's private memory drifted {(d.drift_bytes if d else 0) >> 20} MiB "
            f"over {d.requests if d else 0} requests (bound {(bound or 0) >> 20} MiB)"
        )
        try:
            outcome = await engine.recycle(reason, self.settings.drain_timeout_s)
        except BaseException:
            self.failed += 1
            self.not_before_s = self.clock() + self.settings.retry_s
            raise
        finally:
            self.pending = False
        if outcome.postponed:
            self.postponed += 1
            self.not_before_s = self.clock() + self.settings.retry_s
            events.emit("governor.recycle_postponed", logging.WARNING,
                        drained_s=round(outcome.drained_s, 3), **evidence)  # fmt: skip
            return
        self.count += 1
        record = {
            **evidence,
            "at_unix_s": round(time.time(), 3),
            "pid_before": outcome.pid_before,
            "pid_after": outcome.pid_after,
            "drained_s": round(outcome.drained_s, 3),
            "reload_s": round(outcome.reload_s, 3),
            "waiting": outcome.waiting,
        }
        self.records.append(record)
        events.emit("governor.recycle", logging.WARNING, **record)

    # ------------------------------------------------------------ reporting

    def summary(self) -> dict[str, Any]:
        """The short form for /health (``watch`` and ``top`` read it)."""
        d, f = self.engine_drift, self.front_drift
        return {
            "count": self.count,
            "postponed": self.postponed,
            "failed": self.failed,
            "bound_bytes": self.bound_bytes,
            "engine_drift_bytes": d.drift_bytes if d is not None else None,
            "front_drift_bytes": f.drift_bytes if f is not None else None,
            "last": self.records[-1] if self.records else None,
        }

    def status(self) -> dict[str, Any]:
        """The long form for ``GET /api/v1/governor``."""
        s = self.settings
        return {
            **self.summary(),
            "enabled": s.enabled,
            "warmup_requests": s.warmup_requests,
            "room_fraction": s.room_fraction,
            "idle_fraction": s.idle_fraction,
            "drain_timeout_s": s.drain_timeout_s,
            "engine": self.engine_drift.as_dict() if self.engine_drift is not None else None,
            "front": self.front_drift.as_dict() if self.front_drift is not None else None,
            "recycles": list(self.records),
        }
