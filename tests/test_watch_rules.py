"""The pure rules: trim on sustained working set with cooldown, leaks, exits, OOM cross-check."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from slmguard.host.cgroup import CgroupMemory
from slmguard.host.kmsg import OomKill
from slmguard.host.process import FdCounts
from slmguard.host.procfs import MemInfo
from slmguard.host.psi import Pressure
from slmguard.watch.rules import CRITICAL, HEALTHY, WARNING, RuleState, Thresholds, evaluate
from slmguard.watch.sources import HttpStatus, Snapshot
from slmguard.watch.state import WatchState, load_state, save_state, state_from_dict

MIB = 1 << 20
SVC = "/system.slice/slmguard.service"


def _cg(
    usage_mib: int, *, oom_kill: int = 0, inactive_mib: int = 0, version: int = 2
) -> CgroupMemory:
    return CgroupMemory(
        version=version,
        path=Path("/sys/fs/cgroup" + SVC),
        usage_bytes=usage_mib * MIB,
        inactive_file_bytes=inactive_mib * MIB,
        high_bytes=None,
        max_bytes=1000 * MIB,
        events={"oom_kill": oom_kill},
    )


def _snap(t: float, usage_mib: int = 100, **kw: object) -> Snapshot:
    values: dict[str, object] = {"mono_s": t, "unix_s": 1e9 + t, "cgroup": _cg(usage_mib)}
    values.update(kw)
    return Snapshot(**values)  # type: ignore[arg-type]


def _kill(pid: int, memcg: str = SVC, scope: str = "memcg") -> OomKill:
    return OomKill(
        seq=pid, ts_usec=1, pid=pid, comm="llama-worker", scope=scope, first_seq=pid,
        constraint="CONSTRAINT_MEMCG" if scope == "memcg" else "CONSTRAINT_NONE",
        oom_memcg=memcg, task_memcg=memcg,
    )  # fmt: skip


TH = Thresholds(warn_pct=85, critical_pct=97, sustain_s=30, trim_cooldown_s=300, keep_recent=256)


def test_healthy_when_far_below_the_line() -> None:
    d, _ = evaluate(_snap(0, 500), RuleState(), TH, SVC)
    assert d.level == HEALTHY and d.alerts == () and d.trim_keep_recent is None
    assert d.working_set_pct == 50.0


def test_working_set_not_usage_page_cache_does_not_alarm() -> None:
    snap = _snap(0, cgroup=_cg(950, inactive_mib=300))  # usage 95 %, working set 65 %
    d, _ = evaluate(snap, RuleState(), TH, SVC)
    assert d.level == HEALTHY and d.working_set_bytes == 650 * MIB


def test_sustained_high_working_set_trims_once_per_cooldown() -> None:
    state = RuleState()
    trims = []
    alerts = []
    for t in range(0, 700, 10):
        d, state = evaluate(_snap(t, 900), state, TH, SVC)
        assert d.level == WARNING
        alerts += [a.kind for a in d.alerts]
        if d.trim_keep_recent is not None:
            trims.append((t, d.trim_keep_recent))
    assert trims == [(30, 256), (330, 256), (630, 256)]
    assert alerts == ["memory-high"]  # alerted on entry, not every poll


def test_dip_below_the_line_restarts_the_sustain_clock() -> None:
    state = RuleState()
    seq = [(0, 900), (20, 900), (25, 700), (30, 900), (55, 900), (60, 900)]
    trims = []
    for t, mib in seq:
        d, state = evaluate(_snap(t, mib), state, TH, SVC)
        if d.trim_keep_recent is not None:
            trims.append(t)
    assert trims == [60]


def test_critical_line_and_recovery_alert() -> None:
    d, state = evaluate(_snap(0, 990), RuleState(), TH, SVC)
    assert d.level == CRITICAL
    assert {a.kind for a in d.alerts} == {"memory-critical", "memory-high"}
    d, state = evaluate(_snap(5, 100), state, TH, SVC)
    assert d.level == HEALTHY
    assert sorted(a.facts["condition"] for a in d.alerts if a.kind == "recovered") == [
        "memory-critical",
        "memory-high",
    ]


def test_recoveries_come_after_the_rules_alerts_in_name_order() -> None:
    held = RuleState(in_conditions=frozenset({"server-down", "memory-high", "pressure-high"}))
    snap = _snap(0, 100, pressure=Pressure(15.0, 1.0, 1.0, 1))
    d, state = evaluate(snap, held, TH, SVC)
    # pressure-high still holds (and was already on: no new alert); the others cleared
    assert [a.kind for a in d.alerts] == ["recovered", "recovered"]
    assert [a.facts["condition"] for a in d.alerts] == ["memory-high", "server-down"]
    assert state.in_conditions == {"pressure-high"} and d.level == WARNING


def test_no_cgroup_limit_uses_plan_fallback_then_ram() -> None:
    cg = replace(_cg(900), max_bytes=None)
    d, _ = evaluate(_snap(0, cgroup=cg), RuleState(), TH, SVC)
    assert d.limit_bytes is None and d.level == HEALTHY  # nothing to compare with
    d, _ = evaluate(_snap(0, cgroup=cg), RuleState(), replace(TH, fallback_limit_bytes=1000 * MIB))
    assert d.level == WARNING and d.limit_bytes == 1000 * MIB
    ram = MemInfo(mem_total_bytes=950 * MIB, mem_available_bytes=500 * MIB)
    d, _ = evaluate(_snap(0, cgroup=cg, meminfo=ram), RuleState(), TH, SVC)
    assert d.limit_bytes == 950 * MIB and d.level == WARNING


def test_an_ancestors_smaller_v1_limit_is_the_limit_as_for_the_governor() -> None:
    """One board, one answer: the watcher takes the cgroup's limit the way the governor
    does (host.headroom.effective_limit over the cgroup's candidates), so a v1 parent's
    smaller hierarchical_memory_limit counts, not only the cgroup's own limit_in_bytes."""
    cg = replace(_cg(900, version=1), max_bytes=2000 * MIB,
                 stat={"hierarchical_memory_limit": 1000 * MIB})  # fmt: skip
    d, _ = evaluate(_snap(0, cgroup=cg), RuleState(), TH, SVC)
    assert d.limit_bytes == 1000 * MIB and d.level == WARNING  # 90% of the parent's limit


def test_service_kill_is_critical_with_bundle_other_cgroup_is_warning() -> None:
    snap = _snap(0, kills=(_kill(10), _kill(11, "/user.slice/other")))
    d, _ = evaluate(snap, RuleState(oom_kill_count=0), TH, SVC)
    assert d.level == CRITICAL and d.bundle_reason == "oom-kill"
    assert [k.pid for k in d.service_kills] == [10]
    assert [(a.kind, a.severity) for a in d.alerts if "oom" in a.kind] == [
        ("oom-kill", "critical"),
        ("host-oom-kill", "warning"),
    ]
    only_other = _snap(0, kills=(_kill(11, "/user.slice/other"),))
    d, _ = evaluate(only_other, RuleState(), TH, SVC)
    assert d.level == WARNING and d.bundle_reason is None
    system = _snap(0, kills=(_kill(12, "/user.slice/other", scope="system"),))
    d, _ = evaluate(system, RuleState(), TH, SVC)
    assert d.level == CRITICAL


def test_counter_rise_waits_one_poll_for_the_kernel_report() -> None:
    state = RuleState(oom_kill_count=0)
    # The counter is bumped just before the report is printed: no alert yet.
    d, state = evaluate(_snap(0, cgroup=_cg(100, oom_kill=1)), state, TH, SVC)
    assert d.alerts == () and state.unmatched_counter_kills == 1
    # The report arrives on the next poll: matched, one oom-kill alert, no counter alert.
    d, state = evaluate(_snap(1, cgroup=_cg(100, oom_kill=1), kills=(_kill(7),)), state, TH, SVC)
    assert [a.kind for a in d.alerts] == ["oom-kill"]
    assert state.unmatched_counter_kills == 0


def test_counter_rise_without_any_report_is_reported_after_a_poll() -> None:
    state = RuleState(oom_kill_count=3)
    d, state = evaluate(_snap(0, cgroup=_cg(100, oom_kill=5)), state, TH, SVC)
    assert d.alerts == ()
    d, state = evaluate(_snap(1, cgroup=_cg(100, oom_kill=5)), state, TH, SVC)
    (alert,) = d.alerts
    assert alert.kind == "oom-counter" and alert.facts["unmatched"] == 2
    assert d.level == CRITICAL and d.bundle_reason == "oom-kill"
    d, state = evaluate(_snap(2, cgroup=_cg(100, oom_kill=5)), state, TH, SVC)
    assert d.alerts == ()


def test_first_sight_of_the_counter_is_a_baseline() -> None:
    d, state = evaluate(_snap(0, cgroup=_cg(100, oom_kill=9)), RuleState(), TH, SVC)
    assert d.alerts == () and state.oom_kill_count == 9


def _procs(fds: int, bufs: int = 0, pid: int = 42) -> tuple[FdCounts, ...]:
    return (FdCounts(pid, "slmguard", fds, bufs, bufs * 4096),)


@pytest.mark.parametrize("what", ["fd", "dmabuf"])
def test_counts_that_keep_rising_are_a_leak(what: str) -> None:
    th = replace(TH, leak_window_s=100, leak_min_increase=50)
    state = RuleState()
    leaks = []
    for i, t in enumerate(range(0, 300, 10)):
        n = 10 + 6 * i  # 60 per 100 s window
        procs = _procs(n, 0) if what == "fd" else _procs(10, n)
        d, state = evaluate(_snap(t, processes=procs), state, th, SVC)
        leaks += [t for a in d.alerts if a.kind == f"{what}-leak"]
    assert leaks and leaks[0] >= 100
    # once per window, not every poll
    assert all(b - a >= 100 for a, b in itertools.pairwise(leaks))


def test_counts_that_go_up_and_down_are_not_a_leak() -> None:
    th = replace(TH, leak_window_s=100, leak_min_increase=5)
    state = RuleState()
    for i, t in enumerate(range(0, 400, 10)):
        d, state = evaluate(_snap(t, processes=_procs(20 + (i % 2) * 10)), state, th, SVC)
        assert not [a for a in d.alerts if a.kind.endswith("leak")]


def test_exit_of_a_settled_process_is_critical_with_bundle() -> None:
    state = RuleState()
    for t in (0, 1, 30):  # ran for exit_settle_s (30 s)
        d, state = evaluate(_snap(t, processes=_procs(10)), state, TH, SVC)
    d, state = evaluate(_snap(31, processes=()), state, TH, SVC)
    assert [a.kind for a in d.alerts] == ["process-exit"]
    assert d.level == CRITICAL and d.bundle_reason == "process-exit"


def test_short_lived_process_exit_is_not_an_alarm() -> None:
    state = RuleState()
    for t in (0, 1, 2, 29):  # polled often, but alive for less than 30 s
        d, state = evaluate(_snap(t, processes=_procs(10)), state, TH, SVC)
    d, state = evaluate(_snap(30, processes=()), state, TH, SVC)
    assert d.alerts == ()


def test_killed_process_is_one_event_not_two() -> None:
    state = RuleState(oom_kill_count=0)
    for t in (0, 40):
        _, state = evaluate(_snap(t, processes=_procs(10, pid=7)), state, TH, SVC)
    d, _ = evaluate(_snap(41, processes=(), kills=(_kill(7),)), state, TH, SVC)
    assert [a.kind for a in d.alerts] == ["oom-kill"]


def test_server_down_after_up_is_critical() -> None:
    up = HttpStatus("http://x/health", 200, {"status": "ok"})
    down = HttpStatus("http://x/health", None, error="connection refused")
    d, state = evaluate(_snap(0, health=down), RuleState(), TH, SVC)
    assert d.level == WARNING and d.bundle_reason is None  # never seen up: not a crash
    d, state = evaluate(_snap(1, health=up), state, TH, SVC)
    assert d.level == HEALTHY
    d, state = evaluate(_snap(2, health=down), state, TH, SVC)
    assert d.level == CRITICAL and d.bundle_reason == "server-down"
    d, state = evaluate(_snap(3, health=down), state, TH, SVC)
    assert d.alerts == ()


def test_server_answering_not_ready_is_a_warning_without_bundle() -> None:
    up = HttpStatus("http://x/health", 200, {"state": "ready"})
    loading = HttpStatus("http://x/health", 503, {"state": "loading"})
    _, state = evaluate(_snap(0, health=up), RuleState(), TH, SVC)
    d, state = evaluate(_snap(1, health=loading), state, TH, SVC)
    assert d.level == WARNING and d.bundle_reason is None
    assert [a.kind for a in d.alerts] == ["server-unhealthy"]


def test_pressure_lines() -> None:
    calm = Pressure(1.0, 1.0, 1.0, 10, 0.0, 0.0, 0.0, 0)
    some = replace(calm, some_avg10_pct=15.0)
    full = replace(calm, some_avg10_pct=40.0, full_avg10_pct=25.0)
    assert evaluate(_snap(0, pressure=calm), RuleState(), TH, SVC)[0].level == HEALTHY
    assert evaluate(_snap(0, pressure=some), RuleState(), TH, SVC)[0].level == WARNING
    assert evaluate(_snap(0, pressure=full), RuleState(), TH, SVC)[0].level == CRITICAL


def test_kmsg_lost_records_warn() -> None:
    d, _ = evaluate(_snap(0, kmsg_lost=12), RuleState(), TH, SVC)
    assert d.level == WARNING and d.alerts[0].facts == {"lost": 12}


# ---------------------------------------------------------------- state file


def test_state_round_trip_and_boot_change(tmp_path: Path) -> None:
    path = tmp_path / "watch-state.json"
    assert load_state(path) == WatchState()
    state = WatchState(boot_id="b1", kmsg_seq=42, oom_kill_counts={"/cg": 3}, kills_reported=1)
    save_state(path, state)
    loaded = load_state(path)
    assert loaded == state
    assert loaded.cursor_for("b1") == 42
    assert loaded.cursor_for("b2") is None  # sequence numbers restart at boot
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize(
    "text", ["{not json", '{"version": 99}', '{"version": 1, "kmsg_seq": "x"}', "[]"]
)
def test_corrupt_state_is_moved_aside(tmp_path: Path, text: str) -> None:
    path = tmp_path / "watch-state.json"
    path.write_text(text)
    assert load_state(path) == WatchState()
    assert (tmp_path / "watch-state.json.corrupt").read_text() == text
    assert not path.exists()


def test_state_from_dict_rejects_wrong_types() -> None:
    with pytest.raises(ValueError):
        state_from_dict({"version": 1, "oom_kill_counts": {"a": "b"}})


def _health(
    restarts: int, engine: int, *, stalls: int = 0, in_flight: int = 0, progress: int = 0
) -> HttpStatus:
    return HttpStatus(
        "http://x/health",
        200,
        {"state": "ready", "in_flight": in_flight,
         "engine": {"pid": engine, "restarts": restarts, "stalls": stalls,
                    "progress": progress}},
    )  # fmt: skip


def test_engine_restart_in_health_is_one_critical_event() -> None:
    state = RuleState()
    for t in (0, 1):
        procs = _procs(10, pid=50) + _procs(20, pid=51)
        d, state = evaluate(_snap(t, health=_health(0, 51), processes=procs), state, TH, SVC)
        assert d.alerts == ()
    # the engine (pid 51) died and the server started pid 52
    procs = _procs(10, pid=50) + _procs(20, pid=52)
    d, state = evaluate(_snap(2, health=_health(1, 52), processes=procs), state, TH, SVC)
    assert [a.kind for a in d.alerts] == ["engine-restart"]
    assert d.level == CRITICAL and d.bundle_reason == "engine-exit"
    d, state = evaluate(_snap(3, health=_health(1, 52), processes=procs), state, TH, SVC)
    assert d.alerts == ()


def test_engine_restart_after_its_oom_kill_adds_no_second_bundle() -> None:
    state = RuleState(oom_kill_count=0)
    engine = _procs(20, pid=51)
    for t in (0, 1):
        _, state = evaluate(_snap(t, health=_health(0, 51), processes=engine), state, TH, SVC)
    d, state = evaluate(_snap(2, health=_health(0, 51), kills=(_kill(51),)), state, TH, SVC)
    assert d.bundle_reason == "oom-kill"
    new = _procs(20, pid=52)
    d, state = evaluate(_snap(3, health=_health(1, 52), processes=new), state, TH, SVC)
    (alert,) = d.alerts
    assert alert.kind == "engine-restart" and alert.facts["oom_killed"] is True
    assert "after its OOM kill" in alert.message
    assert d.level == CRITICAL and d.bundle_reason is None


def test_a_stall_the_server_handled_is_one_alert_bundled_with_its_evidence() -> None:
    state = RuleState()
    engine = _procs(20, pid=51)
    for t in (0, 1):
        _, state = evaluate(_snap(t, health=_health(0, 51), processes=engine), state, TH, SVC)
    new = _procs(20, pid=52)
    d, state = evaluate(_snap(2, health=_health(1, 52, stalls=1), processes=new), state, TH, SVC)
    kinds = [a.kind for a in d.alerts]
    assert kinds == ["engine-restart", "engine-stall"]
    assert "after a stall" in d.alerts[0].message
    assert d.bundle_reason == "engine-stall"  # one bundle, the stall's
    d, state = evaluate(_snap(3, health=_health(1, 52, stalls=1), processes=new), state, TH, SVC)
    assert d.alerts == ()


def test_an_engine_with_work_and_no_progress_is_stalled_seen_from_outside() -> None:
    from slmguard.watch.sources import EngineProgress

    th = replace(TH, stall_s=30.0)
    state = RuleState()

    def poll(t: float, busy: bool, counter: int) -> Any:
        nonlocal state
        d, state = evaluate(_snap(t, progress=EngineProgress(busy, counter)), state, th, SVC)
        return d

    assert poll(0, True, 5).alerts == ()
    assert poll(20, True, 9).alerts == ()  # it moved
    assert poll(45, True, 9).alerts == ()  # 25 s still: not yet
    d = poll(51, True, 9)  # 31 s with work and no progress
    assert [a.kind for a in d.alerts] == ["engine-stalled"] and d.level == CRITICAL
    assert d.bundle_reason == "engine-stalled"
    d = poll(60, True, 9)
    assert d.alerts == () and d.level == CRITICAL  # still stalled: alerted once
    assert poll(61, True, 10).level == HEALTHY  # moving again
    assert poll(200, False, 10).alerts == ()  # idle is not a stall, however long
    assert poll(300, False, 10).level == HEALTHY


def _events(**events: int) -> CgroupMemory:
    return replace(_cg(100), events=events)


def test_v2_high_events_rising_is_throttling() -> None:
    state = RuleState()
    d, state = evaluate(_snap(0, cgroup=_events(high=5, oom=0, oom_kill=0)), state, TH, SVC)
    assert d.alerts == ()  # a first reading is a baseline
    d, state = evaluate(_snap(1, cgroup=_events(high=9, oom=0, oom_kill=0)), state, TH, SVC)
    assert [(a.kind, a.facts["high_events"]) for a in d.alerts] == [("throttled", 4)]
    assert d.level == WARNING
    d, state = evaluate(_snap(2, cgroup=_events(high=9, oom=0, oom_kill=0)), state, TH, SVC)
    assert [a.kind for a in d.alerts] == ["recovered"]


def test_v2_oom_without_kill_must_hold_for_two_polls() -> None:
    state = RuleState()
    _, state = evaluate(_snap(0, cgroup=_events(oom=1, oom_kill=1)), state, TH, SVC)
    # read between the kernel's "oom" and "oom_kill" increments: not yet a finding
    d, state = evaluate(_snap(1, cgroup=_events(oom=2, oom_kill=1)), state, TH, SVC)
    assert d.alerts == ()
    killed = _snap(2, cgroup=_events(oom=2, oom_kill=2), kills=(_kill(9),))
    d, state = evaluate(killed, state, TH, SVC)
    assert [a.kind for a in d.alerts] == ["oom-kill"]
    # two OOMs that killed nothing, stable over two polls: one warning
    d, state = evaluate(_snap(3, cgroup=_events(oom=4, oom_kill=2)), state, TH, SVC)
    assert d.alerts == ()
    d, state = evaluate(_snap(4, cgroup=_events(oom=4, oom_kill=2)), state, TH, SVC)
    assert [(a.kind, a.message) for a in d.alerts] == [
        ("oom-no-kill", "the cgroup hit OOM 2 times without a kill")
    ]
    assert d.level == WARNING
    d, state = evaluate(_snap(5, cgroup=_events(oom=4, oom_kill=2)), state, TH, SVC)
    assert d.alerts == ()


def test_v1_under_oom_is_critical_once() -> None:
    cg = replace(_cg(100, version=1), events={"oom_kill": 0, "under_oom": 1, "failcnt": 7})
    d, state = evaluate(_snap(0, cgroup=cg), RuleState(), TH, SVC)
    assert [a.kind for a in d.alerts] == ["under-oom"]
    assert d.level == CRITICAL and d.bundle_reason == "under-oom"
    d, state = evaluate(_snap(1, cgroup=cg), state, TH, SVC)
    assert d.alerts == () and d.level == CRITICAL


def _recycled(count: int, engine: int, *, front: int = 0, last: dict[str, Any] | None = None
              ) -> HttpStatus:  # fmt: skip
    health = _health(0, engine)
    recycle = {"count": count, "bound_bytes": 64 * MIB, "front_drift_bytes": front,
               "engine_drift_bytes": 0, "last": last}  # fmt: skip
    health.body["extra"] = {"governor": {"level": "normal", "recycle": recycle}}
    return health


def test_a_recycled_engine_is_one_info_event_with_its_evidence_not_an_exit() -> None:
    """The governor recycled a leaking engine (issue 40): the new pid, no restart counted;
    watch says so once, with the drift it was recycled for, and no process-exit alert."""
    state = RuleState()
    for t in (0, 40):
        procs = _procs(10, pid=50) + _procs(20, pid=51)
        d, state = evaluate(_snap(t, health=_recycled(0, 51), processes=procs), state, TH, SVC)
        assert d.alerts == ()
    last = {"pid_before": 51, "pid_after": 52, "drift_bytes": 70 * MIB, "bound_bytes": 64 * MIB,
            "requests": 1400, "per_1000_requests_bytes": 50 * MIB, "verdict": "drain"}  # fmt: skip
    procs = _procs(10, pid=50) + _procs(20, pid=52)
    health = _recycled(1, 52, last=last)
    d, state = evaluate(_snap(80, health=health, processes=procs), state, TH, SVC)
    (alert,) = d.alerts
    assert (alert.severity, alert.kind, d.level) == ("info", "engine-recycled", HEALTHY)
    assert "drift 70.0 MiB over 1400 requests, bound 64.0 MiB" in alert.message
    assert alert.facts["pid_before"] == 51 and alert.facts["per_1000_requests_bytes"] == 50 * MIB
    d, state = evaluate(_snap(120, health=health, processes=procs), state, TH, SVC)
    assert d.alerts == ()


def test_the_fronts_own_drift_past_the_bound_warns_once() -> None:
    state = RuleState()
    d, state = evaluate(_snap(0, health=_recycled(0, 51, front=10 * MIB)), state, TH, SVC)
    assert d.alerts == () and d.level == HEALTHY
    for t in (10, 20):
        d, state = evaluate(_snap(t, health=_recycled(0, 51, front=65 * MIB)), state, TH, SVC)
        assert d.level == WARNING
        assert [a.kind for a in d.alerts] == (["front-drift"] if t == 10 else [])
