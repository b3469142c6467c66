"""top.sources, top.events, top.view, top.text: refreshes of a board tree and a stand-in server.

The Collector reads a real fixture tree (RK3588, Jetson) and a loopback
stand-in answering with the recorded bodies; between two refreshes the test
changes files (CPU ticks, memory.events, alerts.jsonl, a crash bundle) and
the answers (engine restarts, governor level), as a board and a server would.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hosttree import build_tree
from slmguard.plan.planfile import load_plan
from slmguard.top.client import ServerClient
from slmguard.top.events import AlertLogTail, derive, parse_alert_line
from slmguard.top.snapshot import (
    EngineView,
    GovernorView,
    MemoryView,
    ServerView,
    TopSnapshot,
    snapshot_to_dict,
)
from slmguard.top.sources import Collector, is_loopback_url, plan_view
from slmguard.top.text import bar_text, render_json, render_screen
from slmguard.top.view import CRIT, OK, WARN, Bar, Field, Note, Table, build_screen, fmt_bytes
from toptrees import (
    FIXTURES,
    JETSON_TOP,
    MIB,
    RK3588_TOP,
    SERVICE,
    contract_routes,
    json_answer,
    proc_stat,
    recorded_json,
    stand_in,
)


def _field(screen: Any, pane: str, label: str) -> Field:
    return next(ln for ln in screen.pane(pane).lines if isinstance(ln, Field) and ln.label == label)


def _table(screen: Any, pane: str, first_header: str) -> Table:
    return next(
        ln
        for ln in screen.pane(pane).lines
        if isinstance(ln, Table) and ln.headers[0] == first_header
    )


def _collector(url: str, root: Path, **kw: Any) -> Collector:
    plan = plan_view(load_plan(FIXTURES / "plan-rk3588-4g.json"), Path("plan.json"))
    return Collector(
        ServerClient(url, admin_token="adm", api_key="key"),
        root=root,
        local=True,
        cgroup_dir=kw.pop("cgroup_dir", root / SERVICE),
        state_dir=root / "var/lib/slmguard",
        plan=plan,
        **kw,
    )


ALERT = {
    "time": "2026-11-30T05:40:01Z", "host": "board", "severity": "critical", "kind": "oom-kill",
    "message": "OOM killer killed llama-server (pid 5150) in the service's cgroup", "facts": {},
}  # fmt: skip


def test_two_refreshes_of_a_throttling_rk3588(tmp_path: Path) -> None:
    root = build_tree(tmp_path, RK3588_TOP)
    state = root / "var/lib/slmguard"
    with stand_in(contract_routes()) as srv:
        c = _collector(srv.url, root)
        first = c.poll()
        # One second later: cores busy, memory.high crossed twice more, an OOM kill
        # reported by the watcher, a crash bundle, the engine restarted.
        (root / "proc/stat").write_text(
            proc_stat({cpu: (1000 * cpu + 10 * cpu, 10_000 + 100 - 10 * cpu) for cpu in range(8)})
        )
        (root / SERVICE / "memory.events").write_text(
            "low 0\nhigh 5\nmax 0\noom 1\noom_kill 1\noom_group_kill 0\n"
        )
        state.mkdir(parents=True)
        (state / "alerts.jsonl").write_text(json.dumps(ALERT) + "\n")
        bundle = state / "crashes" / "20261130T054002Z"
        bundle.mkdir(parents=True)
        (bundle / "summary.json").write_text(json.dumps({
            "reason": "oom-kill", "time": "2026-11-30T05:40:02Z",
            "kills": [{"pid": 5150, "comm": "llama-server"}]}))  # fmt: skip
        (state / "watch-state.json").write_text(json.dumps({"version": 1, "kills_reported": 1}))
        health = recorded_json("contract-health.json")
        health["engine"].update(restarts=3, pid=6262)
        srv.routes[("GET", "/health")] = json_answer(health)
        second = c.poll()
    assert first.board is not None and second.board is not None
    assert [core.busy_pct for core in first.board.cores] == [None] * 8
    assert [round(core.busy_pct) for core in second.board.cores if core.busy_pct is not None] == [
        0, 10, 20, 30, 40, 50, 60, 70,
    ]  # fmt: skip
    assert second.memory is not None
    assert second.memory.events_delta == {"high": 2, "oom": 1, "oom_kill": 1}
    kinds = [(e.source, e.kind) for e in second.events]
    assert ("watch", "oom-kill") in kinds and ("bundle", "crash-bundle") in kinds
    assert ("top", "engine-restart") in kinds and ("top", "oom-kill") in kinds
    restart = next(e for e in second.events if e.kind == "engine-restart")
    assert restart.message == "engine restarted (restarts 2 -> 3, pid 5151 -> 6262)"
    assert second.watch is not None and second.watch.kills_reported == 1
    assert second.watch.bundles == 1 and second.watch.alert_log
    # Auth went where it belongs: the API key to /metrics, the admin token to the governor.
    assert set(srv.auth["/metrics"]) == {"Bearer key"}
    assert set(srv.auth["/api/v1/governor"]) == {"Bearer adm"}
    assert set(srv.auth["/health"]) == {None}

    screen = build_screen(second)
    bar = next(ln for ln in screen.pane("memory").lines if isinstance(ln, Bar))
    # 358 MiB of a 400 MiB MemoryMax; the governor's limit is 384 MiB (memory.high).
    assert bar.fill == pytest.approx(358 / 400, abs=0.01)
    assert [m.label for m in bar.marks] == ["s", "d", "c", "H", "M"]
    assert bar.marks[0].at == pytest.approx(0.85 * 402653184 / (400 * MIB))
    assert bar.flag == WARN and "93.2% of the limit" in bar.text
    assert bar_text(bar, 40) == "[################################s#d#cH.M]"
    events = _field(screen, "memory", "memory.events").value
    assert events.flag == CRIT and "oom_kill 1 (+1)" in events.text and "high 5 (+2)" in events.text
    assert _field(screen, "memory", "swap").value.flag == WARN
    assert _field(screen, "memory", "zram0").value.flag == WARN
    parts = {r[0].text: r for r in _table(screen, "memory", "part").rows}
    assert parts["kv_cache"][2].text == fmt_bytes(18874368)  # planned for 1024 cells
    assert parts["kv_cache"][3].text == fmt_bytes(512 * 18432)  # the 512 cells of now
    assert parts["weights (mapped)"][3].text == fmt_bytes(133169152)
    assert parts["service total"][3].text == "420 MiB"
    assert parts["os_reserve"][4].text == "outside the service"

    gov = screen.pane("governor")
    assert _field(screen, "governor", "level").value.text.startswith("DEGRADE")
    assert _field(screen, "governor", "n_ctx now").value.text == "512 of 1024 (plan 1024)"
    assert _field(screen, "governor", "slots").value.text == "1 busy of 2"
    transitions = _table(screen, "governor", "when")
    assert transitions.rows[0][1].text == "shed -> degrade"  # newest first
    assert gov.flag == WARN

    cores = {r[0].text: r for r in _table(screen, "board", "core").rows}
    assert cores["cpu4"][1].text == "big" and cores["cpu0"][1].text == "little"
    assert cores["cpu4"][4].text == "THROTTLED" and cores["cpu4"][4].flag == CRIT
    assert cores["cpu6"][4].text == "capped 2016 MHz"
    zones = {r[0].text: r for r in _table(screen, "board", "thermal zone").rows}
    assert zones["bigcore0-thermal"][1].flag == CRIT
    assert zones["soc-thermal"][1].flag == OK
    accel = {r[0].text: r for r in _table(screen, "board", "accelerator").rows}
    assert accel["rknpu"][2].text == "37% 0% 12%"

    assert _field(screen, "engine", "stalls").value.flag == CRIT
    assert _field(screen, "engine", "requests").value.text == "ok 44  429 5  503 15"
    assert _field(screen, "engine", "decode speed").value.text == "38.2 tok/s (server)"
    slots = _table(screen, "engine", "slot")
    assert [r[2].text for r in slots.rows] == ["157 / 512", "29 / 512"]
    timeline = _table(screen, "events", "time")
    assert {r[1].text for r in timeline.rows} >= {"oom-kill", "crash-bundle", "engine-restart"}

    text = render_screen(screen)
    for needle in ("THROTTLED [!!]", "DEGRADE for 12s", "157 / 512", "needs root"[:0],
                   "marks: s shed"):  # fmt: skip
        assert needle in text
    data = json.loads(render_json(second))
    assert data["schema"] == "slmguard.top/1"
    assert data["server"]["engine"]["slots"][0]["kv_cells_used"] == 157
    assert data["memory"]["events_delta"]["oom_kill"] == 1


def test_jetson_and_a_today_server(tmp_path: Path) -> None:
    root = build_tree(tmp_path, JETSON_TOP)
    with stand_in(contract_routes("today")) as srv:
        c = _collector(srv.url, root, cgroup_dir=None)
        snap = c.poll()
    screen = build_screen(snap)
    assert snap.memory is not None and snap.memory.cgroup_path is None
    assert _field(screen, "memory", "cgroup").value.flag == WARN
    bar = next(ln for ln in screen.pane("memory").lines if isinstance(ln, Bar))
    assert "(governor, limits from the plan)" in bar.text  # no cgroup: the governor's number
    accel = _table(screen, "board", "accelerator")
    assert [c.text for c in accel.rows[0]] == ["17000000.gpu", "GPU", "34%", "n/a"]
    zones = {r[0].text: r[1].text for r in _table(screen, "board", "thermal zone").rows}
    assert zones == {"cpu-thermal": "no temp file", "gpu-thermal": "48.5 C"}
    cores = _table(screen, "board", "core")
    assert {r[1].text for r in cores.rows} == {""}  # all cores alike: no big/little mark
    assert _field(screen, "engine", "version").value.text == "n/a"
    assert _field(screen, "governor", "transitions").value.text == "normal->shed 1"


def test_unreachable_server_is_shown_and_recovers(tmp_path: Path) -> None:
    root = build_tree(tmp_path, RK3588_TOP)
    with stand_in(contract_routes()) as srv:
        url = srv.url
        c = _collector(url, root)
        assert c.poll().server.reachable
    down = c.poll()  # the stand-in is gone
    assert not down.server.reachable
    screen = build_screen(down)
    assert screen.title.flag == CRIT and "UNREACHABLE" in screen.title.text
    assert screen.pane("engine").lines == (Note(f"server unreachable: {down.server.error}", CRIT),)
    assert any(e.kind == "server-down" for e in down.events)
    assert down.board is not None  # the board is still read
    assert "UNREACHABLE" in render_screen(screen)


def test_remote_server_reads_no_board(tmp_path: Path) -> None:
    assert is_loopback_url("http://localhost:8080") and is_loopback_url("http://[::1]:8080")
    assert is_loopback_url("http://127.0.0.2:8080")
    assert not is_loopback_url("http://board.local:8080")
    assert not Collector(ServerClient("http://board.local:8080"), root=tmp_path).local
    # --no-local: no board files are read (the server here is a closed loopback port).
    with stand_in() as srv:
        url = srv.url
    c = Collector(ServerClient(url, timeout_s=1.0), root=tmp_path, local=False)
    snap = c.poll()
    assert snap.memory is None and snap.board is None
    screen = build_screen(snap)
    assert "not on the board" in render_screen(screen)


def test_level_changes_seen_by_top_become_transitions(tmp_path: Path) -> None:
    routes = contract_routes("today")
    del routes[("GET", "/api/v1/governor")]  # no status: /health's summary only
    health = recorded_json("today-health.json")
    with stand_in(routes) as srv:
        c = _collector(srv.url, build_tree(tmp_path, JETSON_TOP), cgroup_dir=None)
        c.poll()
        health["extra"]["governor"]["level"] = "degrade"
        srv.routes[("GET", "/health")] = json_answer(health)
        snap = c.poll()
    (t,) = snap.server.governor.recent
    assert (t.from_level, t.to_level, t.seen_by) == ("shed", "degrade", "top")
    assert t.reason and "budget" in t.reason
    level = next(e for e in snap.events if e.kind == "level")
    assert level.severity == "warning" and level.message.startswith("governor shed -> degrade")
    assert snap.server.governor_error == "HTTP 404"


# ---------------------------------------------------------------- events, pure


def _server(**engine: Any) -> ServerView:
    gov = engine.pop("governor", GovernorView())
    return ServerView("u", reachable=engine.pop("reachable", True),
                      engine=EngineView(**engine), governor=gov)  # fmt: skip


@pytest.mark.parametrize(
    ("before", "after", "kinds"),
    [
        (_server(state="ready"), _server(state="restarting"), ["state"]),
        (_server(state="ready"), _server(state="stalled"), ["state"]),
        (_server(restarts=1, pid=1), _server(restarts=2, pid=2), ["engine-restart"]),
        (_server(pid=1), _server(pid=2), ["engine-pid"]),
        (_server(stalls=0), _server(stalls=1), ["stall"]),
        (_server(), _server(reachable=False), ["server-down"]),
        (_server(reachable=False), _server(state="ready"), ["server-up"]),
        (_server(governor=GovernorView(parked=False)), _server(governor=GovernorView(parked=True)),
         ["park"]),
        (_server(restarts=None), _server(restarts=3), []),
        (_server(state="ready"), _server(state="ready"), []),
    ],
)  # fmt: skip
def test_derive(before: ServerView, after: ServerView, kinds: list[str]) -> None:
    assert [e.kind for e in derive(before, after, None, 1.0)] == kinds


def test_a_recycle_is_one_info_event_with_what_it_was_for() -> None:
    """The governor recycled a leaking engine (issue 40): one "recycle" event saying the
    drift, not an "engine-pid" warning for the new pid."""
    said = "engine recycled for a leak: drift 70.0 MiB over 1400 requests (bound 64.0 MiB)"
    before = _server(pid=1, governor=GovernorView(recycles=0))
    after = _server(pid=2, governor=GovernorView(recycles=1, last_recycle=said))
    (e,) = derive(before, after, None, 1.0)
    assert (e.kind, e.severity, e.message) == ("recycle", "info", said)
    screen = render_screen(build_screen(TopSnapshot(
        taken_unix_s=1.0, server=replace(after, governor=replace(
            after.governor, source="health", level="normal", drift_bound_bytes=64 << 20,
            engine_drift_bytes=5 << 20, front_drift_bytes=1 << 20)))))  # fmt: skip
    assert "leak drift" in screen and "engine 5 MiB, front 1 MiB of 64 MiB; 1 recycled" in screen


def test_derive_severities_and_memory_events() -> None:
    (e,) = derive(_server(state="ready"), _server(state="stalled"), None, 1.0)
    assert e.severity == "critical"
    (e,) = derive(_server(state="loading"), _server(state="ready"), None, 1.0)
    assert e.severity == "info"
    mem = MemoryView(events={"oom_kill": 2, "high": 9}, events_delta={"oom_kill": 2, "high": 1})
    assert [(e.kind, e.severity) for e in derive(None, _server(), mem, 1.0)] == [
        ("oom-kill", "critical"), ("memory-high", "warning"),
    ]  # fmt: skip


def test_alert_log_tail_follows_appends_partial_lines_and_rotation(tmp_path: Path) -> None:
    log = tmp_path / "alerts.jsonl"
    tail = AlertLogTail(log)
    assert tail.read() == []
    line = json.dumps(ALERT)
    log.write_text("x" * 70000 + "\n" + line + "\n" + line[:20])
    first = tail.read()
    assert [e.kind for e in first] == ["oom-kill"]  # the cut first line of the tail is dropped
    with log.open("a") as fh:
        fh.write(line[20:] + "\n" + "{not json\n")
    assert [e.kind for e in tail.read()] == ["oom-kill"]  # the partial line, now complete
    assert tail.read() == []
    log.write_text(line.replace("oom-kill", "worker-restart") + "\n")  # rotated: smaller
    assert [e.kind for e in tail.read()] == ["worker-restart"]


@pytest.mark.parametrize(
    "line",
    ["[]", "{}", '{"time": "yesterday", "kind": "x", "message": "y"}',
     '{"time": "2026-11-30T05:40:01Z", "kind": 1, "message": "y"}', "\x00\x01"],
)  # fmt: skip
def test_bad_alert_lines_are_skipped(line: str) -> None:
    assert parse_alert_line(line) is None


def test_unknown_severity_is_a_warning() -> None:
    event = parse_alert_line(json.dumps(dict(ALERT, severity="panic")))
    assert event is not None and event.severity == "warning" and event.source == "watch"


def _device_screen(**gov: Any) -> Any:
    governor = GovernorView(
        source="status", working_set_bytes=600 * MIB, limit_bytes=1024 * MIB,
        limit_source="memory.high", shed_pct=85.0, critical_pct=97.0, **gov,
    )  # fmt: skip
    return build_screen(TopSnapshot(time.time(), ServerView("u", True, governor=governor)))


def _memory_bar(screen: Any) -> Bar:
    return next(ln for ln in screen.pane("memory").lines if isinstance(ln, Bar))


def test_the_device_memory_the_governor_counts_is_shown_beside_the_working_set() -> None:
    screen = _device_screen(device_bytes=300 * MIB, device_source="devmem")
    lines = screen.pane("memory").lines
    assert isinstance(lines[1], Field) and lines[1].label == "device memory"  # under the bar
    assert lines[1].value.text == "300 MiB outside the cgroup (devmem)"
    # The governor's limit carries the device allowance: 900 of 1024 MiB is past shed.
    bar = _memory_bar(screen)
    assert "87.9% of the limit with the device memory" in bar.text and bar.flag == WARN
    assert "device memory" in render_screen(screen)
    counted_none = _device_screen(device_bytes=0, device_source="NvMapMemUsed")
    assert _field(counted_none, "memory", "device memory").value.text.startswith("0 B outside")
    from_metric = _device_screen(device_bytes=64 * MIB)  # the metric says no source
    metric_line = _field(from_metric, "memory", "device memory").value.text
    assert metric_line == "64 MiB outside the cgroup (slmguard_governor_device_bytes)"


@pytest.mark.parametrize("gov", [{}, {"device_bytes": 0}])
def test_no_device_line_where_the_governor_counts_none(gov: dict[str, Any]) -> None:
    screen = _device_screen(**gov)
    labels = [ln.label for ln in screen.pane("memory").lines if isinstance(ln, Field)]
    assert "device memory" not in labels
    bar = _memory_bar(screen)
    assert "58.6% of the limit (" in bar.text and bar.flag == OK


def test_json_of_an_empty_snapshot_is_complete() -> None:
    snap = TopSnapshot(taken_unix_s=time.time(), server=ServerView("u"))
    data = snapshot_to_dict(snap)
    assert data["memory"] is None and data["server"]["engine"]["slots"] == []
    snap2 = replace(snap, server=replace(snap.server, reachable=True))
    assert "n/a" in render_screen(build_screen(snap2))


def test_a_board_lists_its_models_in_the_engine_pane() -> None:
    from slmguard.top.snapshot import ModelView

    server = ServerView(
        "http://127.0.0.1:8080", reachable=True, engine=EngineView(state="ready"),
        models=(
            ModelView("chat", "ready", "pinned", 100, pid=11, rss_bytes=300 * MIB,
                      n_ctx_cells=1024, n_ctx_full_cells=2048, in_flight=1, queue_depth=0),
            ModelView("embed", "unloaded", "on_demand", 30),
            ModelView("big", "parked", "on_demand", 20, parked=True),
        ),
    )  # fmt: skip
    snap = TopSnapshot(taken_unix_s=0.0, server=server)
    (table,) = [ln for ln in build_screen(snap).pane("engine").lines if isinstance(ln, Table)]
    assert table.title == "models"
    rows = {r[0].text: r for r in table.rows}
    assert rows["chat"][5].text == "1024" and rows["chat"][5].flag == WARN  # reduced
    assert rows["embed"][2].text == "unloaded" and rows["embed"][2].flag is None  # not a fault
    assert rows["big"][5].text == "PARKED" and rows["big"][1].text == "on-demand 20"
    text = render_screen(build_screen(snap))
    assert "models:" in text and "on-demand 30" in text
