"""The events timeline: watch's alerts, crash bundles, and what top saw change.

Owns three sources of :class:`~slmguard.top.snapshot.Event`:

- ``<state_dir>/alerts.jsonl``, the watcher's alert log (one JSON object a
  line: ``time``, ``severity``, ``kind``, ``message``; see
  :mod:`slmguard.watch.alerts`): OOM kills, engine restarts and stalls, exits, pressure.
  :class:`AlertLogTail` reads the last 64 KiB once, then only what was
  appended; a file that shrank was rotated and is read from its start.
- ``<state_dir>/crashes/<UTC time>/summary.json``, crash bundles
  (:mod:`slmguard.watch.bundle`): one event per bundle, read once.
- :func:`derive`, pure: the difference between two refreshes (the server
  going away or coming back, a state change, engine restarts, stalls, a new
  engine pid, governor level changes, an engine recycled for a leak, the cgroup's
  ``oom_kill``, ``max`` and ``high`` events rising).

Also :func:`read_watch_state` for the watcher's ``kills_reported`` count. A
line, bundle or state file that does not parse is skipped: the timeline
shows what it can, and never stops top.
"""

from __future__ import annotations

import calendar
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slmguard.top.snapshot import EngineView, Event, GovernorView, MemoryView, ServerView

ALERT_LOG = "alerts.jsonl"
CRASH_DIR = "crashes"
WATCH_STATE = "watch-state.json"
FIRST_READ_BYTES = 64 << 10
MAX_READ_BYTES = 1 << 20
MAX_BUNDLES = 200
SEVERITIES = ("info", "warning", "critical")


def parse_utc(text: Any) -> float | None:
    """``2026-11-30T05:40:01Z`` -> unix seconds; None when it is not that."""
    if not isinstance(text, str):
        return None
    try:
        return float(calendar.timegm(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def parse_alert_line(line: str) -> Event | None:
    """One alerts.jsonl line as an event; None when it is not an alert record."""
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    when = parse_utc(data.get("time"))
    kind, message = data.get("kind"), data.get("message")
    if when is None or not isinstance(kind, str) or not isinstance(message, str):
        return None
    severity = data.get("severity")
    if severity not in SEVERITIES:
        severity = "warning"
    return Event(when, str(severity), kind[:40], message[:300], "watch")


@dataclass
class AlertLogTail:
    """Follows one alerts.jsonl across refreshes (see the module docstring)."""

    path: Path
    offset: int | None = None
    partial: bytes = b""

    def read(self) -> list[Event]:
        try:
            size = self.path.stat().st_size
        except OSError:
            self.offset, self.partial = None, b""
            return []
        if self.offset is not None and size == self.offset:
            return []
        start = max(0, size - FIRST_READ_BYTES) if self.offset is None else self.offset
        if size < start:  # rotated or truncated
            start, self.partial = 0, b""
        try:
            with self.path.open("rb") as fh:
                fh.seek(start)
                data = fh.read(min(size - start, MAX_READ_BYTES))
        except OSError:
            return []
        first_read = self.offset is None and start > 0
        self.offset = start + len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()  # an incomplete last line waits for the next refresh
        if first_read and lines:
            lines = lines[1:]  # the first line of a tail is cut
        out = []
        for raw in lines:
            event = parse_alert_line(raw.decode("utf-8", errors="replace"))
            if event is not None:
                out.append(event)
        return out


def bundle_event(directory: Path) -> Event | None:
    """The event for one crash bundle, from its summary.json."""
    try:
        with (directory / "summary.json").open("rb") as fh:
            data = json.loads(fh.read(MAX_READ_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    when = parse_utc(data.get("time"))
    if when is None:
        return None
    reason = str(data.get("reason", "?"))[:80]
    kills = data.get("kills")
    victims = ""
    if isinstance(kills, list) and kills:
        names = [f"{k.get('comm')} ({k.get('pid')})" for k in kills[:3] if isinstance(k, dict)]
        victims = ": killed " + ", ".join(names)
    return Event(
        when,
        "critical",
        "crash-bundle",
        f"crash bundle {directory.name} ({reason}){victims}",
        "bundle",
    )


@dataclass
class BundleWatch:
    """New crash bundles under ``<state_dir>/crashes`` since the last refresh."""

    crash_dir: Path
    seen: set[str] = field(default_factory=set)

    def read(self) -> list[Event]:
        try:
            names = sorted(
                e.name
                for e in os.scandir(self.crash_dir)
                if e.is_dir() and not e.name.startswith(".")
            )[-MAX_BUNDLES:]
        except OSError:
            return []
        out = []
        for name in names:
            if name in self.seen:
                continue
            self.seen.add(name)
            event = bundle_event(self.crash_dir / name)
            if event is not None:
                out.append(event)
        return out

    @property
    def count(self) -> int:
        return len(self.seen)


def read_watch_state(state_dir: Path) -> int | None:
    """The watcher's ``kills_reported`` (None without a readable state file)."""
    try:
        with (state_dir / WATCH_STATE).open("rb") as fh:
            data = json.loads(fh.read(MAX_READ_BYTES))
    except (OSError, ValueError):
        return None
    kills = data.get("kills_reported") if isinstance(data, dict) else None
    return kills if isinstance(kills, int) and not isinstance(kills, bool) else None


# ---------------------------------------------------------------- derived


_BAD_STATES = ("stalled", "failed", "stopped")


def _engine_events(a: EngineView, b: EngineView, now: float) -> list[Event]:
    """A state change, a restart (else a new pid), a stall."""
    out = []
    if a.state != b.state and a.state is not None and b.state is not None:
        severity = (
            "critical"
            if b.state in _BAD_STATES
            else ("info" if b.state in ("ready", "degraded") else "warning")
        )
        out.append(Event(now, severity, "state", f"server {a.state} -> {b.state}", "top"))
    if a.restarts is not None and b.restarts is not None and b.restarts > a.restarts:
        pids = f", pid {a.pid} -> {b.pid}" if a.pid != b.pid and b.pid is not None else ""
        message = f"engine restarted (restarts {a.restarts} -> {b.restarts}{pids})"
        out.append(Event(now, "critical", "engine-restart", message, "top"))
    elif a.pid is not None and b.pid is not None and a.pid != b.pid:
        out.append(Event(now, "warning", "engine-pid", f"engine pid {a.pid} -> {b.pid}", "top"))
    if a.stalls is not None and b.stalls is not None and b.stalls > a.stalls:
        message = f"engine stalled (stalls {a.stalls} -> {b.stalls})"
        out.append(Event(now, "critical", "stall", message, "top"))
    return out


def _governor_events(
    ga: GovernorView, gb: GovernorView, reason: str | None, now: float
) -> list[Event]:
    """A level change (a warning going up, with the reason), parking and resuming, and a
    heat step (the governor's thermal level, with the zone's temperature)."""
    out = []
    if ga.level and gb.level and ga.level != gb.level:
        up = _level_rank(gb.level) > _level_rank(ga.level)
        pressure = f" at {gb.pressure_pct:.1f}%" if gb.pressure_pct is not None else ""
        because = f": {reason}" if reason and up else ""
        message = f"governor {ga.level} -> {gb.level}{pressure}{because}"
        out.append(Event(now, "warning" if up else "info", "level", message, "top"))
    if _recycled(ga, gb):
        message = gb.last_recycle or f"engine recycled for a leak ({gb.recycles} so far)"
        out.append(Event(now, "info", "recycle", message, "top"))
    if ga.parked is not None and gb.parked is not None and ga.parked != gb.parked:
        what = "parked the engine" if gb.parked else "resumed the engine"
        out.append(
            Event(now, "warning" if gb.parked else "info", "park", f"governor {what}", "top")
        )
    ha, hb = ga.heat, gb.heat
    if ha is not None and hb is not None and ha.level and hb.level and ha.level != hb.level:
        heats = ("cool", "warm", "hot", "limit")
        up = (
            hb.level in heats
            and ha.level in heats
            and heats.index(hb.level) > heats.index(ha.level)
        )
        where = f" ({hb.zone} {hb.temp_c:.1f} C)" if hb.zone and hb.temp_c is not None else ""
        slots = f": {hb.slots} of {hb.planned_slots} slots" if hb.slots is not None else ""
        message = f"heat {ha.level} -> {hb.level}{where}{slots}"
        out.append(Event(now, "warning" if up else "info", "heat", message, "top"))
    return out


def _recycled(ga: GovernorView, gb: GovernorView) -> bool:
    return ga.recycles is not None and gb.recycles is not None and gb.recycles > ga.recycles


def _server_events(prev: ServerView, cur: ServerView, now: float) -> list[Event]:
    """The server going away or coming back; else what changed in its engine and governor."""
    if prev.reachable != cur.reachable and not cur.reachable:
        message = f"server not answering: {cur.error or 'no answer'}"
        return [Event(now, "critical", "server-down", message, "top")]
    if prev.reachable != cur.reachable:
        message = f"server answers again ({cur.engine.state})"
        return [Event(now, "info", "server-up", message, "top")]
    if not cur.reachable:
        return []
    reason = cur.engine.degraded_reasons.get("memory")
    engine = _engine_events(prev.engine, cur.engine, now)
    if _recycled(prev.governor, cur.governor):  # the new pid is the recycle's, said below
        engine = [e for e in engine if e.kind != "engine-pid"]
    return engine + _governor_events(prev.governor, cur.governor, reason, now)


def _level_rank(level: str) -> int:
    order = ("normal", "shed", "degrade", "critical")
    return order.index(level) if level in order else -1


_MEMORY_EVENTS = (
    ("oom_kill", "critical", "oom-kill", "the OOM killer killed {n} process(es) in the cgroup"),
    ("max", "warning", "memory-max", "the cgroup hit memory.max {n} time(s)"),
    ("high", "warning", "memory-high", "the cgroup went over memory.high {n} time(s)"),
)


def derive(
    prev_server: ServerView | None,
    cur_server: ServerView,
    memory: MemoryView | None,
    now: float,
) -> list[Event]:
    """Events from one refresh to the next (pure)."""
    out = [] if prev_server is None else _server_events(prev_server, cur_server, now)
    if memory is not None:
        for key, severity, kind, text in _MEMORY_EVENTS:
            n = memory.events_delta.get(key, 0)
            if n > 0:
                out.append(Event(now, severity, kind, text.format(n=n), "top"))
    return out
