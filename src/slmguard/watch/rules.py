"""Pure decisions on snapshots: which alerts, whether to trim, whether to bundle.

:func:`evaluate` takes a :class:`~slmguard.watch.sources.Snapshot`, the
previous :class:`RuleState` and the thresholds, and returns a
:class:`Decision` and the next state. No I/O, no clock: time comes from the
snapshot (``mono_s``), so tests drive it with literal numbers.

The rules:

* **OOM kill** (critical, crash bundle): every kill in the kernel log; kills in
  the watched cgroup (or below it) are the service's, others are reported as
  host kills. The cgroup's ``oom_kill`` counter is the cross-check: a rise not
  matched by a kernel report within one poll (the counter is bumped just
  before the report is printed) is reported on its own.
* **Working set** (usage - inactive_file) at or above ``warn_pct`` of the
  limit is a warning; held for ``sustain_s`` it asks for one trim call, then
  no other before ``trim_cooldown_s``; at or above ``critical_pct`` it is
  critical.
* **Memory events**: v2 ``high`` events rising (throttled above
  memory.high) warn; ``oom`` rising more than ``oom_kill`` (the OOM killer
  ran and killed nothing) warns; v1 ``under_oom`` (tasks stalled with the
  OOM killer disabled) is critical.
* **PSI**: memory ``some`` avg10 above ``psi_warn_pct`` warns, ``full`` avg10
  above ``psi_critical_pct`` is critical.
* **Leaks**: fd or DMA-BUF handle counts that never fell during the last
  ``leak_window_s`` and rose by at least ``leak_min_increase`` warn (once per
  window).
* **Exits**: a watched process that ran for ``exit_settle_s`` (seen on two
  polls at least that far apart) and disappears is an unexpected exit
  (critical, crash bundle; short-lived helpers are not); so is a rise of the server's
  ``worker_restarts`` in /health (the engine worker died and the server
  restarted it); a server that answered /health and stops answering at all
  is critical (and bundled); one that answers non-2xx (loading, restarting
  its worker) is a warning.

Alerts fire on the transition into a condition, not on every poll; the level
(0 healthy, 1 warning, 2 critical) always reflects the current poll.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
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
    def level_name(self) -> str:
        return LEVEL_NAMES[self.level]

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
    worker_restarts: int | None = None
    worker_pid: int | None = None  # from /health: its exits count as worker restarts
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


def evaluate(
    snap: Snapshot,
    prev: RuleState,
    th: Thresholds,
    service_cgroup: str | None = None,
) -> tuple[Decision, RuleState]:
    """Decide on one snapshot. ``service_cgroup``: the kernel path of the watched cgroup."""
    now = snap.mono_s
    alerts: list[Alert] = []
    level = HEALTHY
    bundle: list[str] = []
    active: set[str] = set()

    def raise_level(to: int) -> None:
        nonlocal level
        level = max(level, to)

    # --- OOM kills from the kernel log
    service_kills = tuple(
        k for k in snap.kills if service_cgroup is not None and k.in_cgroup(service_cgroup)
    )
    other_kills = tuple(k for k in snap.kills if k not in service_kills)
    for k in service_kills:
        alerts.append(
            Alert(
                "critical",
                "oom-kill",
                f"OOM killer killed {k.comm} (pid {k.pid}) in the service's cgroup",
                _kill_facts(k),
            )
        )
    for k in other_kills:
        scope = "the system ran out of memory" if k.scope == "system" else "its cgroup limit"
        alerts.append(
            Alert(
                "critical" if service_cgroup is None or k.scope == "system" else "warning",
                "oom-kill" if service_cgroup is None else "host-oom-kill",
                f"OOM killer killed {k.comm} (pid {k.pid}): {scope}",
                _kill_facts(k),
            )
        )
    if service_kills or (other_kills and service_cgroup is None):
        raise_level(CRITICAL)
        bundle.append("oom-kill")
    elif other_kills:
        raise_level(CRITICAL if any(k.scope == "system" for k in other_kills) else WARNING)
    if snap.kmsg_lost:
        alerts.append(
            Alert(
                "warning",
                "kmsg-lost",
                f"{snap.kmsg_lost} kernel log records were overwritten before they were read",
                {"lost": snap.kmsg_lost},
            )
        )
        raise_level(WARNING)

    # --- the cgroup's oom_kill counter
    count = snap.cgroup.oom_kill_count if snap.cgroup else None
    unmatched = 0
    if count is not None and prev.oom_kill_count is not None and count >= prev.oom_kill_count:
        rise = count - prev.oom_kill_count
        pending = prev.unmatched_counter_kills + rise
        matched = min(pending, len(service_kills) if service_cgroup else len(snap.kills))
        pending -= matched
        if pending and prev.unmatched_counter_kills:
            # Unmatched for a whole poll: the kernel report is not coming.
            alerts.append(
                Alert(
                    "critical",
                    "oom-counter",
                    f"the cgroup's oom_kill counter rose by {pending} without a kernel report",
                    {"oom_kill": count, "unmatched": pending},
                )
            )
            raise_level(CRITICAL)
            bundle.append("oom-kill")
            pending = 0
        unmatched = pending

    # --- the other memory events: v2 memory.events, v1 memory.oom_control
    events = dict(snap.cgroup.events) if snap.cgroup else {}
    rises = {
        k: v - prev.events[k] for k, v in events.items() if k in prev.events and v > prev.events[k]
    }
    if rises.get("high"):
        # v2: allocations were throttled above memory.high (reclaim forced).
        active.add("throttled")
        raise_level(WARNING)
        if "throttled" not in prev.in_conditions:
            alerts.append(
                Alert(
                    "warning",
                    "throttled",
                    f"the cgroup went over memory.high {rises['high']} times since the last poll",
                    {"high_events": rises["high"]},
                )
            )
    # v2: the OOM killer ran but killed nothing (the victim was already exiting,
    # or every task is OOM-protected). "oom" is counted before "oom_kill", so a
    # read between the two sees a gap that closes: it must hold for two polls.
    gap = events["oom"] - events.get("oom_kill", 0) if "oom" in events else None
    confirmed_gap = prev.oom_gap
    if gap is not None and confirmed_gap is None:
        confirmed_gap = gap
    elif gap is not None and confirmed_gap is not None:
        if gap > confirmed_gap and gap == prev.oom_gap_last:
            raise_level(WARNING)
            alerts.append(
                Alert(
                    "warning",
                    "oom-no-kill",
                    f"the cgroup hit OOM {gap - confirmed_gap} times without a kill",
                    {"oom": events["oom"], "oom_kill": events.get("oom_kill", 0)},
                )
            )
            confirmed_gap = gap
        elif gap < confirmed_gap:
            confirmed_gap = gap  # counters reset (the cgroup was recreated)
    if events.get("under_oom"):
        # v1 with oom_kill_disable=1: tasks are frozen until memory is freed.
        active.add("under-oom")
        raise_level(CRITICAL)
        if "under-oom" not in prev.in_conditions:
            alerts.append(
                Alert("critical", "under-oom", "the cgroup is under OOM (its tasks are stalled)")
            )
            bundle.append("under-oom")

    # --- working set against the limit
    ws, limit = snap.working_set(th.fallback_limit_bytes)
    trim = None
    above_since = None
    last_trim = prev.last_trim_s
    pct = used_pct(ws, limit)
    if ws is not None and limit and pct is not None:
        facts = {"working_set_bytes": ws, "limit_bytes": limit, "pct": round(pct, 1)}
        if pct >= th.critical_pct:
            active.add("memory-critical")
            raise_level(CRITICAL)
            if "memory-critical" not in prev.in_conditions:
                alerts.append(
                    Alert(
                        "critical", "memory-critical", f"working set at {pct:.0f}% of limit", facts
                    )
                )
        if pct >= th.warn_pct:
            active.add("memory-high")
            raise_level(WARNING)
            above_since = prev.above_since_s if prev.above_since_s is not None else now
            if "memory-high" not in prev.in_conditions:
                alerts.append(
                    Alert("warning", "memory-high", f"working set at {pct:.0f}% of limit", facts)
                )
            cooled = last_trim is None or now - last_trim >= th.trim_cooldown_s
            if now - above_since >= th.sustain_s and cooled:
                trim = th.keep_recent
                last_trim = now

    # --- pressure stall information
    p = snap.pressure
    if p is not None:
        if p.full_avg10_pct is not None and p.full_avg10_pct >= th.psi_critical_pct:
            active.add("pressure-critical")
            raise_level(CRITICAL)
            if "pressure-critical" not in prev.in_conditions:
                alerts.append(
                    Alert(
                        "critical",
                        "pressure-critical",
                        f"memory PSI full avg10 {p.full_avg10_pct:.1f}%",
                        {"full_avg10_pct": p.full_avg10_pct},
                    )
                )
        elif p.some_avg10_pct >= th.psi_warn_pct:
            active.add("pressure-high")
            raise_level(WARNING)
            if "pressure-high" not in prev.in_conditions:
                alerts.append(
                    Alert(
                        "warning",
                        "pressure-high",
                        f"memory PSI some avg10 {p.some_avg10_pct:.1f}%",
                        {"some_avg10_pct": p.some_avg10_pct},
                    )
                )

    # --- leaks: fds and DMA-BUF handles that keep rising
    fd_hist = _push(prev.fd_history, now, snap.fd_count, th.leak_window_s)
    buf_hist = _push(prev.dmabuf_history, now, snap.dmabuf_count, th.leak_window_s)
    leak_alerted = dict(prev.leak_alerted_s)
    for what, hist in (("fd", fd_hist), ("dmabuf", buf_hist)):
        if _rising(hist, th.leak_window_s, th.leak_min_increase):
            raise_level(WARNING)
            last = leak_alerted.get(what)
            if last is None or now - last >= th.leak_window_s:
                leak_alerted[what] = now
                alerts.append(
                    Alert(
                        "warning",
                        f"{what}-leak",
                        f"{what} count rose from {hist[0][1]} to {hist[-1][1]} "
                        f"in {hist[-1][0] - hist[0][0]:.0f} s without falling",
                        {"from": hist[0][1], "to": hist[-1][1]},
                    )
                )

    # --- exits of watched processes, server reachability
    current = {pc.pid: pc.comm for pc in snap.processes}
    killed_pids = {k.pid for k in snap.kills}
    for pid, comm in prev.settled_pids.items():
        if pid not in current and pid not in killed_pids and pid != prev.worker_pid:
            alerts.append(
                Alert(
                    "critical",
                    "process-exit",
                    f"watched process {comm} (pid {pid}) exited",
                    {"pid": pid, "comm": comm},
                )
            )
            raise_level(CRITICAL)
            bundle.append("process-exit")
    first_seen = {pid: prev.first_seen_s.get(pid, now) for pid in current}
    settled = {
        pid: c
        for pid, c in current.items()
        if pid in prev.first_seen_s and now - first_seen[pid] >= th.exit_settle_s
    }
    server_up = prev.server_seen_up
    h = snap.health
    if h is not None and h.ok:
        server_up = True
    elif h is not None and h.status is not None:
        # It answers but is not ready (engine loading or restarting): degraded.
        active.add("server-unhealthy")
        raise_level(WARNING)
        if "server-unhealthy" not in prev.in_conditions:
            state_word = h.body.get("state") if isinstance(h.body, dict) else None
            alerts.append(
                Alert(
                    "warning",
                    "server-unhealthy",
                    f"server health is HTTP {h.status} ({state_word or 'no state'})",
                    {"url": h.url, "status": h.status, "state": state_word},
                )
            )
    elif h is not None:
        active.add("server-down")
        raise_level(CRITICAL if server_up else WARNING)
        if "server-down" not in prev.in_conditions:
            alerts.append(
                Alert(
                    "critical" if server_up else "warning",
                    "server-down",
                    f"server does not answer: {h.error}",
                    {"url": h.url, "error": h.error},
                )
            )
            if server_up:
                bundle.append("server-down")

    service_seen = prev.service_seen or bool(snap.service_present)
    if snap.service_present is False:
        # Before it ever ran (boot order): a warning; after it ran: it is down.
        active.add("service-absent")
        raise_level(CRITICAL if service_seen else WARNING)
        if "service-absent" not in prev.in_conditions:
            alerts.append(
                Alert(
                    "critical" if service_seen else "warning",
                    "service-absent",
                    "the watched unit is not running (its cgroup is gone)",
                )
            )

    # The server restarts a dead engine worker itself and counts it in /health.
    restarts = health_field(snap.health, "worker_restarts")
    killed_recently = (*prev.killed_pids, *(k.pid for k in snap.kills))[-64:]
    rose = (
        restarts is not None
        and prev.worker_restarts is not None
        and restarts > prev.worker_restarts
    )
    if rose:
        # An OOM-killed worker already has its alert and bundle: say so, add none.
        oom = prev.worker_pid is not None and prev.worker_pid in killed_recently
        cause = " after its OOM kill" if oom else ""
        alerts.append(
            Alert(
                "critical",
                "worker-restart",
                f"the engine worker died{cause} and was restarted ({restarts} restarts so far)",
                {"worker_restarts": restarts, "worker_pid": prev.worker_pid, "oom_killed": oom},
            )
        )
        raise_level(CRITICAL)
        if not oom:
            bundle.append("worker-exit")
    if restarts is None:
        restarts = prev.worker_restarts

    for gone in prev.in_conditions - active:
        alerts.append(Alert("info", "recovered", f"{gone} cleared", {"condition": gone}))

    state = replace(
        prev,
        above_since_s=above_since,
        last_trim_s=last_trim,
        in_conditions=frozenset(active),
        oom_kill_count=count if count is not None else prev.oom_kill_count,
        events=events if snap.cgroup else prev.events,
        oom_gap=confirmed_gap,
        oom_gap_last=gap,
        unmatched_counter_kills=unmatched,
        fd_history=fd_hist,
        dmabuf_history=buf_hist,
        leak_alerted_s=leak_alerted,
        first_seen_s=first_seen,
        settled_pids=settled,
        server_seen_up=server_up,
        worker_restarts=restarts,
        service_seen=service_seen,
        killed_pids=killed_recently,
        worker_pid=health_field(snap.health, "worker_pid") or prev.worker_pid,
    )
    decision = Decision(
        level=level,
        alerts=tuple(alerts),
        trim_keep_recent=trim,
        bundle_reason=bundle[0] if bundle else None,
        service_kills=service_kills,
        other_kills=other_kills,
        working_set_bytes=ws,
        limit_bytes=limit,
    )
    return decision, state
