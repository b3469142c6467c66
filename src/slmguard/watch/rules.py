"""Pure decisions on snapshots: which alerts, whether to trim, whether to bundle.

Owns :func:`evaluate`: a :class:`~slmguard.watch.sources.Snapshot`, the previous
:class:`RuleState` and the :class:`Thresholds` in, a :class:`Decision` and the next
state out. Each rule is one function ``(Poll) -> Verdict`` (its level, alerts, active
conditions, bundle reasons and the state fields it owns); :data:`RULES` lists them in
report order (OOM kills and the ``oom_kill`` counter, memory events, working set,
PSI, fd and DMA-BUF leaks, process exits, the server's health, engine restarts,
stalls and recycles, progress) and :func:`evaluate` folds them, as ``slmguard.doctor``
folds its checks. Alerts fire on the transition into a condition; the level (0
healthy, 1 warning, 2 critical) always reflects the current poll. ``docs/watch.md`` (Rules
and their settings) tables each rule, its threshold and its alert.

It must do no I/O and read no clock: time comes from the snapshot (``mono_s``), so tests
drive it with literal numbers. Reading is :mod:`slmguard.watch.sources`, acting the
watcher's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from slmguard.host.headroom import used_pct
from slmguard.host.kmsg import OomKill
from slmguard.watch.sources import Snapshot, health_field

HEALTHY, WARNING, CRITICAL = 0, 1, 2
LEVEL_NAMES = {HEALTHY: "healthy", WARNING: "warning", CRITICAL: "critical"}


@dataclass(frozen=True)
class Thresholds:
    warn_pct: float = 85.0
    critical_pct: float = 97.0
    sustain_s: float = 30.0
    trim_cooldown_s: float = 300.0
    keep_recent: int = 512
    leak_window_s: float = 600.0
    leak_min_increase: int = 64
    psi_warn_pct: float = 10.0
    psi_critical_pct: float = 20.0
    fallback_limit_bytes: int | None = None
    exit_settle_s: float = 30.0
    stall_s: float = 60.0


@dataclass(frozen=True)
class Alert:
    severity: str  # "warning" | "critical" | "info"
    kind: str  # oom-kill, host-oom-kill, oom-counter, memory-high, memory-critical, ...
    message: str
    facts: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    level: int
    alerts: tuple[Alert, ...] = ()
    trim_keep_recent: int | None = None  # set: call the trim API with this keep_recent
    bundle_reason: str | None = None
    service_kills: tuple[OomKill, ...] = ()
    other_kills: tuple[OomKill, ...] = ()
    working_set_bytes: int | None = None
    limit_bytes: int | None = None

    @property
    def working_set_pct(self) -> float | None:
        return used_pct(self.working_set_bytes, self.limit_bytes)


@dataclass(frozen=True)
class RuleState:
    above_since_s: float | None = None
    last_trim_s: float | None = None
    in_conditions: frozenset[str] = frozenset()
    oom_kill_count: int | None = None
    events: Mapping[str, int] = field(default_factory=dict)  # the cgroup's last events
    oom_gap: int | None = None  # v2 oom - oom_kill already accounted for
    oom_gap_last: int | None = None  # ... and as read on the previous poll
    unmatched_counter_kills: int = 0
    fd_history: tuple[tuple[float, int], ...] = ()
    dmabuf_history: tuple[tuple[float, int], ...] = ()
    leak_alerted_s: Mapping[str, float] = field(default_factory=dict)
    first_seen_s: Mapping[int, float] = field(default_factory=dict)  # pid -> time first seen
    settled_pids: Mapping[int, str] = field(default_factory=dict)  # alive >= exit_settle_s
    server_seen_up: bool = False
    engine_restarts: int | None = None
    engine_pid: int | None = None  # from /health: its exits count as engine restarts
    engine_stalls: int | None = None
    engine_recycles: int | None = None  # /health's extra.governor.recycle.count
    progress_counter: int | None = None  # the engine's progress counter, last seen moving
    progress_since_s: float | None = None  # ... since then, while it had work
    service_seen: bool = False
    killed_pids: tuple[int, ...] = ()  # recent OOM victims (newest last, at most 64)


def _kill_facts(k: OomKill) -> dict[str, Any]:
    return {
        "pid": k.pid,
        "comm": k.comm,
        "scope": k.scope,
        "constraint": k.constraint,
        "oom_memcg": k.oom_memcg,
        "task_memcg": k.task_memcg,
        "anon_rss_bytes": k.anon_rss_bytes,
        "file_rss_bytes": k.file_rss_bytes,
        "shmem_rss_bytes": k.shmem_rss_bytes,
        "kmsg_seq": k.seq,
    }


def _rising(history: tuple[tuple[float, int], ...], window_s: float, min_rise: int) -> bool:
    """Never fell inside the window, the window is covered, and it rose enough."""
    if len(history) < 3 or history[-1][0] - history[0][0] < window_s:
        return False
    values = [n for _, n in history]
    never_fell = all(b >= a for a, b in itertools.pairwise(values))
    return never_fell and values[-1] - values[0] >= min_rise


def _push(
    history: tuple[tuple[float, int], ...], now: float, value: int | None, window_s: float
) -> tuple[tuple[float, int], ...]:
    if value is None:
        return ()
    kept = [(t, n) for t, n in history if now - t <= window_s]
    # Keep one sample older than the window so "the window is covered" can be seen.
    older = [(t, n) for t, n in history if now - t > window_s]
    if older:
        kept.insert(0, older[-1])
    kept.append((now, value))
    return tuple(kept)


@dataclass(frozen=True)
class Poll:
    """What every rule sees: this poll's snapshot, the previous state, the lines.

    The facts several rules share are derived once here: the kills in and
    outside the service's cgroup, and the working set against its limit.
    """

    snap: Snapshot
    prev: RuleState
    th: Thresholds
    service_cgroup: str | None  # the watched cgroup's kernel path, if known
    service_kills: tuple[OomKill, ...]
    other_kills: tuple[OomKill, ...]
    working_set_bytes: int | None
    limit_bytes: int | None

    @property
    def now(self) -> float:
        return self.snap.mono_s

    def entering(self, condition: str, alert: Alert) -> tuple[Alert, ...]:
        """``alert`` when ``condition`` was not already on at the last poll, else nothing."""
        return () if condition in self.prev.in_conditions else (alert,)


@dataclass(frozen=True)
class Verdict:
    """One rule's say on one poll. ``state``: the :class:`RuleState` fields it sets."""

    level: int = HEALTHY
    alerts: tuple[Alert, ...] = ()
    active: frozenset[str] = frozenset()  # conditions on now (alerted on entry only)
    bundle: tuple[str, ...] = ()  # crash bundle reasons, the first one is used
    trim_keep_recent: int | None = None
    state: Mapping[str, Any] = field(default_factory=dict)


Rule = Callable[[Poll], Verdict]


def rule_oom_kills(p: Poll) -> Verdict:
    """Every kill in the kernel log; the service's are critical and bundled."""
    alerts = [
        Alert(
            "critical",
            "oom-kill",
            f"OOM killer killed {k.comm} (pid {k.pid}) in the service's cgroup",
            _kill_facts(k),
        )
        for k in p.service_kills
    ]
    for k in p.other_kills:
        scope = "the system ran out of memory" if k.scope == "system" else "its cgroup limit"
        alerts.append(
            Alert(
                "critical" if p.service_cgroup is None or k.scope == "system" else "warning",
                "oom-kill" if p.service_cgroup is None else "host-oom-kill",
                f"OOM killer killed {k.comm} (pid {k.pid}): {scope}",
                _kill_facts(k),
            )
        )
    level, bundle = HEALTHY, tuple[str, ...]()
    if p.service_kills or (p.other_kills and p.service_cgroup is None):
        level, bundle = CRITICAL, ("oom-kill",)
    elif p.other_kills:
        level = CRITICAL if any(k.scope == "system" for k in p.other_kills) else WARNING
    lost = p.snap.kmsg_lost
    if lost:
        alerts.append(
            Alert(
                "warning",
                "kmsg-lost",
                f"{lost} kernel log records were overwritten before they were read",
                {"lost": lost},
            )
        )
        level = max(level, WARNING)
    return Verdict(level, tuple(alerts), bundle=bundle)


def rule_oom_counter(p: Poll) -> Verdict:
    """The cgroup's oom_kill counter: a rise no kernel report matched within a poll."""
    count = p.snap.cgroup.oom_kill_count if p.snap.cgroup else None
    prev_count = p.prev.oom_kill_count
    state: dict[str, Any] = {
        "oom_kill_count": count if count is not None else prev_count,
        "unmatched_counter_kills": 0,
    }
    if count is None or prev_count is None or count < prev_count:
        return Verdict(state=state)
    pending = p.prev.unmatched_counter_kills + count - prev_count
    reported = len(p.service_kills) if p.service_cgroup else len(p.snap.kills)
    pending -= min(pending, reported)
    if not (pending and p.prev.unmatched_counter_kills):
        # The counter is bumped just before the report is printed: wait one poll.
        return Verdict(state={**state, "unmatched_counter_kills": pending})
    alert = Alert(
        "critical",
        "oom-counter",
        f"the cgroup's oom_kill counter rose by {pending} without a kernel report",
        {"oom_kill": count, "unmatched": pending},
    )
    return Verdict(CRITICAL, (alert,), bundle=("oom-kill",), state=state)


def _oom_gap(p: Poll, events: Mapping[str, int]) -> tuple[int | None, int | None, bool]:
    """(gap now, confirmed gap, whether it grew) for v2 ``oom`` - ``oom_kill``.

    "oom" is counted before "oom_kill", so a read between the two sees a gap
    that closes again: a larger gap counts only once it held for two polls.
    """
    gap = events["oom"] - events.get("oom_kill", 0) if "oom" in events else None
    confirmed = p.prev.oom_gap
    if gap is None:
        return gap, confirmed, False
    if confirmed is None:
        return gap, gap, False
    if gap > confirmed and gap == p.prev.oom_gap_last:
        return gap, gap, True
    if gap < confirmed:
        return gap, gap, False  # counters reset (the cgroup was recreated)
    return gap, confirmed, False


def rule_memory_events(p: Poll) -> Verdict:
    """v2 memory.events (high, oom without a kill) and v1 memory.oom_control (under_oom)."""
    events = dict(p.snap.cgroup.events) if p.snap.cgroup else {}
    prev_events = p.prev.events
    rises = {k: v - prev_events[k] for k, v in events.items() if k in prev_events}
    level, bundle = HEALTHY, tuple[str, ...]()
    alerts: list[Alert] = []
    active: set[str] = set()
    if rises.get("high", 0) > 0:
        # v2: allocations were throttled above memory.high (reclaim forced).
        level = WARNING
        active.add("throttled")
        alerts += p.entering(
            "throttled",
            Alert(
                "warning",
                "throttled",
                f"the cgroup went over memory.high {rises['high']} times since the last poll",
                {"high_events": rises["high"]},
            ),
        )
    # v2: the OOM killer ran but killed nothing (the victim was already exiting,
    # or every task is OOM-protected).
    gap, confirmed, grew = _oom_gap(p, events)
    if grew and gap is not None and p.prev.oom_gap is not None:
        level = max(level, WARNING)
        alerts.append(
            Alert(
                "warning",
                "oom-no-kill",
                f"the cgroup hit OOM {gap - p.prev.oom_gap} times without a kill",
                {"oom": events["oom"], "oom_kill": events.get("oom_kill", 0)},
            )
        )
    if events.get("under_oom"):
        # v1 with oom_kill_disable=1: tasks are frozen until memory is freed.
        level = CRITICAL
        active.add("under-oom")
        entered = p.entering(
            "under-oom",
            Alert("critical", "under-oom", "the cgroup is under OOM (its tasks are stalled)"),
        )
        alerts += entered
        bundle = ("under-oom",) if entered else ()
    state = {
        "events": events if p.snap.cgroup else prev_events,
        "oom_gap": confirmed,
        "oom_gap_last": gap,
    }
    return Verdict(level, tuple(alerts), frozenset(active), bundle, state=state)


def rule_working_set(p: Poll) -> Verdict:
    """Working set against the limit: warn, trim when it holds, critical near the limit."""
    ws, limit = p.working_set_bytes, p.limit_bytes
    pct = used_pct(ws, limit)
    state: dict[str, Any] = {"above_since_s": None, "last_trim_s": p.prev.last_trim_s}
    if pct is None:
        return Verdict(state=state)
    facts = {"working_set_bytes": ws, "limit_bytes": limit, "pct": round(pct, 1)}
    message = f"working set at {pct:.0f}% of limit"
    level, trim = HEALTHY, None
    alerts: list[Alert] = []
    active: set[str] = set()
    if pct >= p.th.critical_pct:
        level = CRITICAL
        active.add("memory-critical")
        alerts += p.entering(
            "memory-critical", Alert("critical", "memory-critical", message, facts)
        )
    if pct >= p.th.warn_pct:
        level = max(level, WARNING)
        active.add("memory-high")
        alerts += p.entering("memory-high", Alert("warning", "memory-high", message, facts))
        above_since = p.prev.above_since_s if p.prev.above_since_s is not None else p.now
        last_trim = p.prev.last_trim_s
        cooled = last_trim is None or p.now - last_trim >= p.th.trim_cooldown_s
        if p.now - above_since >= p.th.sustain_s and cooled:
            trim, last_trim = p.th.keep_recent, p.now
        state = {"above_since_s": above_since, "last_trim_s": last_trim}
    return Verdict(level, tuple(alerts), frozenset(active), trim_keep_recent=trim, state=state)


def rule_pressure(p: Poll) -> Verdict:
    """Memory PSI: ``full`` avg10 at the critical line, else ``some`` avg10 at the warning one."""
    psi = p.snap.pressure
    if psi is None:
        return Verdict()
    full = psi.full_avg10_pct
    if full is not None and full >= p.th.psi_critical_pct:
        alert = Alert(
            "critical",
            "pressure-critical",
            f"memory PSI full avg10 {full:.1f}%",
            {"full_avg10_pct": full},
        )
        active = frozenset({"pressure-critical"})
        return Verdict(CRITICAL, p.entering("pressure-critical", alert), active)
    if psi.some_avg10_pct >= p.th.psi_warn_pct:
        alert = Alert(
            "warning",
            "pressure-high",
            f"memory PSI some avg10 {psi.some_avg10_pct:.1f}%",
            {"some_avg10_pct": psi.some_avg10_pct},
        )
        return Verdict(WARNING, p.entering("pressure-high", alert), frozenset({"pressure-high"}))
    return Verdict()


def rule_leaks(p: Poll) -> Verdict:
    """fd and DMA-BUF handle counts that kept rising over the window (once per window)."""
    window = p.th.leak_window_s
    fd_hist = _push(p.prev.fd_history, p.now, p.snap.fd_count, window)
    buf_hist = _push(p.prev.dmabuf_history, p.now, p.snap.dmabuf_count, window)
    alerted = dict(p.prev.leak_alerted_s)
    level = HEALTHY
    alerts: list[Alert] = []
    for what, hist in (("fd", fd_hist), ("dmabuf", buf_hist)):
        if not _rising(hist, window, p.th.leak_min_increase):
            continue
        level = WARNING
        last = alerted.get(what)
        if last is None or p.now - last >= window:
            alerted[what] = p.now
            alerts.append(
                Alert(
                    "warning",
                    f"{what}-leak",
                    f"{what} count rose from {hist[0][1]} to {hist[-1][1]} "
                    f"in {hist[-1][0] - hist[0][0]:.0f} s without falling",
                    {"from": hist[0][1], "to": hist[-1][1]},
                )
            )
    state = {"fd_history": fd_hist, "dmabuf_history": buf_hist, "leak_alerted_s": alerted}
    return Verdict(level, tuple(alerts), state=state)


def rule_process_exits(p: Poll) -> Verdict:
    """A watched process that had settled and is gone, not by an OOM kill nor an engine restart."""
    current = {pc.pid: pc.comm for pc in p.snap.processes}
    killed = {k.pid for k in p.snap.kills}
    alerts = tuple(
        Alert(
            "critical",
            "process-exit",
            f"watched process {comm} (pid {pid}) exited",
            {"pid": pid, "comm": comm},
        )
        for pid, comm in p.prev.settled_pids.items()
        if pid not in current and pid not in killed and pid != p.prev.engine_pid
    )
    first_seen = {pid: p.prev.first_seen_s.get(pid, p.now) for pid in current}
    settled = {
        pid: comm
        for pid, comm in current.items()
        if pid in p.prev.first_seen_s and p.now - first_seen[pid] >= p.th.exit_settle_s
    }
    return Verdict(
        CRITICAL if alerts else HEALTHY,
        alerts,
        bundle=("process-exit",) if alerts else (),
        state={"first_seen_s": first_seen, "settled_pids": settled},
    )


def rule_server_health(p: Poll) -> Verdict:
    """/health: not ready is a warning; gone after it answered is critical (and bundled)."""
    h = p.snap.health
    seen_up = p.prev.server_seen_up
    if h is None or h.ok:
        return Verdict(state={"server_seen_up": seen_up or (h is not None)})
    if h.status is not None:
        # It answers but is not ready (engine loading or restarting): degraded.
        state_word = h.body.get("state") if isinstance(h.body, dict) else None
        alert = Alert(
            "warning",
            "server-unhealthy",
            f"server health is HTTP {h.status} ({state_word or 'no state'})",
            {"url": h.url, "status": h.status, "state": state_word},
        )
        return Verdict(
            WARNING,
            p.entering("server-unhealthy", alert),
            frozenset({"server-unhealthy"}),
            state={"server_seen_up": seen_up},
        )
    alert = Alert(
        "critical" if seen_up else "warning",
        "server-down",
        f"server does not answer: {h.error}",
        {"url": h.url, "error": h.error},
    )
    entered = p.entering("server-down", alert)
    return Verdict(
        CRITICAL if seen_up else WARNING,
        entered,
        frozenset({"server-down"}),
        bundle=("server-down",) if entered and seen_up else (),
        state={"server_seen_up": seen_up},
    )


def rule_service_presence(p: Poll) -> Verdict:
    """The watched unit's cgroup is gone: a warning before it ever ran (boot order), else down."""
    seen = p.prev.service_seen or bool(p.snap.service_present)
    if p.snap.service_present is not False:
        return Verdict(state={"service_seen": seen})
    alert = Alert(
        "critical" if seen else "warning",
        "service-absent",
        "the watched unit is not running (its cgroup is gone)",
    )
    return Verdict(
        CRITICAL if seen else WARNING,
        p.entering("service-absent", alert),
        frozenset({"service-absent"}),
        state={"service_seen": seen},
    )


def rule_engine_restarts(p: Poll) -> Verdict:
    """A rise of /health's ``engine.restarts``: the server restarted a dead engine."""
    restarts = health_field(p.snap.health, "engine.restarts")
    killed_recently = (*p.prev.killed_pids, *(k.pid for k in p.snap.kills))[-64:]
    state: dict[str, Any] = {
        "engine_restarts": restarts if restarts is not None else p.prev.engine_restarts,
        "killed_pids": killed_recently,
        "engine_pid": health_field(p.snap.health, "engine.pid") or p.prev.engine_pid,
    }
    before = p.prev.engine_restarts
    if restarts is None or before is None or restarts <= before:
        return Verdict(state=state)
    # An OOM-killed engine already has its alert and bundle: say so, add none.
    oom = p.prev.engine_pid is not None and p.prev.engine_pid in killed_recently
    stalled = (health_field(p.snap.health, "engine.stalls") or 0) > (p.prev.engine_stalls or 0)
    cause = " after its OOM kill" if oom else " after a stall" if stalled else ""
    alert = Alert(
        "critical",
        "engine-restart",
        f"the engine died{cause} and was restarted ({restarts} restarts so far)",
        {"engine_restarts": restarts, "engine_pid": p.prev.engine_pid, "oom_killed": oom},
    )
    bundle = () if oom or stalled else ("engine-exit",)
    return Verdict(CRITICAL, (alert,), bundle=bundle, state=state)


def rule_engine_stalls(p: Poll) -> Verdict:
    """A rise of /health's ``engine.stalls``: the server replaced a wedged engine."""
    stalls = health_field(p.snap.health, "engine.stalls")
    state = {"engine_stalls": stalls if stalls is not None else p.prev.engine_stalls}
    before = p.prev.engine_stalls
    if stalls is None or before is None or stalls <= before:
        return Verdict(state=state)
    alert = Alert(
        "critical",
        "engine-stall",
        f"the server found its engine making no progress and replaced it ({stalls} so far)",
        {"engine_stalls": stalls, "engine_pid": p.prev.engine_pid},
    )
    return Verdict(CRITICAL, (alert,), bundle=("engine-stall",), state=state)


def rule_engine_recycles(p: Poll) -> Verdict:
    """/health's ``extra.governor.recycle``: each engine recycled for a leak is reported
    (info: the server gave the leak back on purpose, nothing failed) with its evidence;
    the front's own drift at or past the bound warns (the front is not recycled)."""
    rec = _recycle_summary(p.snap.health)
    count = health_field(p.snap.health, "extra.governor.recycle.count")
    state = {"engine_recycles": count if count is not None else p.prev.engine_recycles}
    alerts: list[Alert] = []
    before = p.prev.engine_recycles
    if count is not None and before is not None and count > before:
        found = rec.get("last")
        last: dict[str, Any] = found if isinstance(found, dict) else {}
        drift, bound = last.get("drift_bytes"), last.get("bound_bytes")
        alerts.append(Alert(
            "info", "engine-recycled",
            f"the server recycled its engine for a leak ({count} so far): drift "
            f"{_mib(drift)} MiB over {last.get('requests')} requests, bound {_mib(bound)} MiB",
            {"engine_recycles": count, **{k: last.get(k) for k in _RECYCLE_FACTS}},
        ))  # fmt: skip
    front, bound = rec.get("front_drift_bytes"), rec.get("bound_bytes")
    if not (isinstance(front, int) and isinstance(bound, int) and front >= bound > 0):
        return Verdict(alerts=tuple(alerts), state=state)
    alert = Alert(
        "warning", "front-drift",
        f"the server's front holds {_mib(front)} MiB more than its baseline (bound "
        f"{_mib(bound)} MiB): a leak in slmguard itself; restart the service when idle",
        {"front_drift_bytes": front, "bound_bytes": bound},
    )  # fmt: skip
    alerts += p.entering("front-drift", alert)
    return Verdict(WARNING, tuple(alerts), frozenset({"front-drift"}), state=state)


_RECYCLE_FACTS = ("pid_before", "pid_after", "drift_bytes", "bound_bytes", "requests",
                  "per_1000_requests_bytes", "drained_s", "reload_s", "verdict")  # fmt: skip


def _recycle_summary(health: Any) -> dict[str, Any]:
    body = health.body if health is not None else None
    for key in ("extra", "governor", "recycle"):
        body = body.get(key) if isinstance(body, dict) else None
    return body if isinstance(body, dict) else {}


def _mib(value: Any) -> str:
    return f"{value / (1 << 20):.1f}" if isinstance(value, int | float) else "?"


def rule_progress(p: Poll) -> Verdict:
    """Seen from outside: work pending and the engine's progress counter standing still."""
    prog = p.snap.progress
    if prog is None or not prog.busy:
        return Verdict(state={"progress_counter": None, "progress_since_s": None})
    if prog.counter != p.prev.progress_counter or p.prev.progress_since_s is None:
        return Verdict(state={"progress_counter": prog.counter, "progress_since_s": p.now})
    still_s = p.now - p.prev.progress_since_s
    if still_s < p.th.stall_s:
        return Verdict()
    alert = Alert(
        "critical",
        "engine-stalled",
        f"the engine has work but made no progress for {still_s:.0f} s",
        {"progress_counter": prog.counter, "still_s": round(still_s, 1)},
    )
    return Verdict(
        CRITICAL,
        p.entering("engine-stalled", alert),
        frozenset({"engine-stalled"}),
        bundle=("engine-stalled",) if "engine-stalled" not in p.prev.in_conditions else (),
    )


#: Every rule, in the order their alerts are reported.
RULES: tuple[Rule, ...] = (
    rule_oom_kills,
    rule_oom_counter,
    rule_memory_events,
    rule_working_set,
    rule_pressure,
    rule_leaks,
    rule_process_exits,
    rule_server_health,
    rule_service_presence,
    rule_engine_restarts,
    rule_engine_stalls,
    rule_engine_recycles,
    rule_progress,
)


def evaluate(
    snap: Snapshot,
    prev: RuleState,
    th: Thresholds,
    service_cgroup: str | None = None,
) -> tuple[Decision, RuleState]:
    """Decide on one snapshot: every rule of :data:`RULES`, folded into one decision.

    ``service_cgroup``: the kernel path of the watched cgroup. The level is the
    highest any rule gives; alerts come in rule order, then a ``recovered``
    for each condition that was on at the last poll and no rule holds now (in
    name order).
    """
    service_kills = tuple(
        k for k in snap.kills if service_cgroup is not None and k.in_cgroup(service_cgroup)
    )
    ws, limit = snap.working_set(th.fallback_limit_bytes)
    poll = Poll(
        snap=snap,
        prev=prev,
        th=th,
        service_cgroup=service_cgroup,
        service_kills=service_kills,
        other_kills=tuple(k for k in snap.kills if k not in service_kills),
        working_set_bytes=ws,
        limit_bytes=limit,
    )
    verdicts = [rule(poll) for rule in RULES]
    active = frozenset().union(*(v.active for v in verdicts))
    recovered = tuple(
        Alert("info", "recovered", f"{gone} cleared", {"condition": gone})
        for gone in sorted(prev.in_conditions - active)
    )
    bundle = [reason for v in verdicts for reason in v.bundle]
    trim = next((v.trim_keep_recent for v in verdicts if v.trim_keep_recent is not None), None)
    updates: dict[str, Any] = {}
    for v in verdicts:
        updates.update(v.state)
    decision = Decision(
        level=max(v.level for v in verdicts),
        alerts=(*(a for v in verdicts for a in v.alerts), *recovered),
        trim_keep_recent=trim,
        bundle_reason=bundle[0] if bundle else None,
        service_kills=poll.service_kills,
        other_kills=poll.other_kills,
        working_set_bytes=ws,
        limit_bytes=limit,
    )
    return decision, replace(prev, in_conditions=active, **updates)
