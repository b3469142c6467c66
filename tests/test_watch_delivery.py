"""Alert delivery (log, webhook on a real loopback server, command) and crash bundles."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slmguard.errors import HostReadError
from slmguard.host.kmsg import find_oom_kills, parse_records
from slmguard.watch.alerts import AlertSink
from slmguard.watch.bundle import (
    BundleInputs,
    journal_tail,
    list_bundles,
    prune_bundles,
    write_bundle,
)
from slmguard.watch.client import parse_response
from slmguard.watch.client import request as http_request
from slmguard.watch.rules import Alert
from watchhttp import recording_server

FIXTURES = Path(__file__).parent / "fixtures" / "kmsg"
ALERT = Alert(
    "critical", "oom-kill", "OOM killer killed llama (pid 7)", {"pid": 7, "comm": "llama"}
)


def test_alert_log_is_json_lines(tmp_path: Path) -> None:
    sink = AlertSink(tmp_path / "state" / "alerts.jsonl")
    sink.emit(ALERT, unix_s=0)
    sink.emit(Alert("info", "recovered", "memory-high cleared"), unix_s=60)
    lines = [json.loads(x) for x in (tmp_path / "state" / "alerts.jsonl").read_text().splitlines()]
    assert [(x["kind"], x["time"]) for x in lines] == [
        ("oom-kill", "1970-01-01T00:00:00Z"),
        ("recovered", "1970-01-01T00:01:00Z"),
    ]
    assert lines[0]["facts"] == {"pid": 7, "comm": "llama"}
    assert lines[0]["severity"] == "critical" and lines[0]["host"]


def test_the_alert_log_is_private_whatever_the_umask(tmp_path: Path) -> None:
    # Issue 37: alerts.jsonl was 0644 in a 0755 directory (it names processes, pids and
    # memory of the board). 0600 like the crash bundles; one made before is narrowed.
    old = os.umask(0)
    try:
        fresh = tmp_path / "new" / "alerts.jsonl"
        AlertSink(fresh).emit(ALERT)
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
        assert stat.S_IMODE(fresh.parent.stat().st_mode) == 0o700
        before = tmp_path / "alerts.jsonl"
        before.write_text('{"kind": "earlier"}\n')
        before.chmod(0o644)
        AlertSink(before).emit(ALERT)
        assert stat.S_IMODE(before.stat().st_mode) == 0o600
        assert len(before.read_text().splitlines()) == 2  # appended, nothing lost
    finally:
        os.umask(old)
    target = tmp_path / "elsewhere"
    target.write_text("")
    linked = tmp_path / "linked" / "alerts.jsonl"
    linked.parent.mkdir()
    linked.symlink_to(target)
    with pytest.raises(HostReadError, match="cannot append alert"):
        AlertSink(linked).emit(ALERT)
    assert target.read_text() == ""


def test_unwritable_alert_log_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(HostReadError, match="cannot append alert"):
        AlertSink(blocker / "alerts.jsonl").emit(ALERT)


def test_webhook_receives_the_alert_json(tmp_path: Path) -> None:
    with recording_server({("POST", "/hook"): (204, None)}) as srv:
        sink = AlertSink(tmp_path / "alerts.jsonl", webhook_url=srv.url + "/hook")
        delivery = sink.emit(ALERT)
        (req,) = srv.calls("POST", "/hook")
    assert delivery.webhook_status == 204 and delivery.webhook_error is None
    assert req.headers["content-type"] == "application/json"
    assert req.body["kind"] == "oom-kill" and req.body["facts"]["pid"] == 7
    logged = json.loads((tmp_path / "alerts.jsonl").read_text())
    assert logged == req.body  # the webhook gets exactly what the log holds


@pytest.mark.parametrize(
    ("path", "want_status", "want_error"),
    [("/fails", 500, "HTTP 500"), ("/missing", 404, "HTTP 404")],
)
def test_webhook_http_errors_are_logged_not_raised(
    tmp_path: Path, path: str, want_status: int, want_error: str
) -> None:
    with recording_server({("POST", "/fails"): (500, {"e": 1})}) as srv:
        sink = AlertSink(tmp_path / "alerts.jsonl", webhook_url=srv.url + path)
        delivery = sink.emit(ALERT)
    assert (delivery.webhook_status, delivery.webhook_error) == (want_status, want_error)
    assert sink.failures == 1
    assert (tmp_path / "alerts.jsonl").exists()


def test_unreachable_webhook_does_not_stop_the_watcher(tmp_path: Path) -> None:
    with recording_server({}) as srv:
        url = srv.url
    sink = AlertSink(tmp_path / "alerts.jsonl", webhook_url=url + "/gone", timeout_s=2)
    delivery = sink.emit(ALERT)
    assert delivery.webhook_status is None and delivery.webhook_error
    assert sink.failures == 1


def test_alert_command_gets_json_on_stdin_and_env(tmp_path: Path) -> None:
    out = tmp_path / "got.txt"
    script = (
        "import os, sys; open(sys.argv[1], 'w').write("
        "os.environ['SLMGUARD_ALERT_KIND'] + '|' + os.environ['SLMGUARD_ALERT_SEVERITY']"
        " + '|' + sys.stdin.read())"
    )
    command = shlex.join([sys.executable, "-c", script, str(out)])
    sink = AlertSink(tmp_path / "alerts.jsonl", command=command)
    delivery = sink.emit(ALERT)
    assert delivery.command_exit == 0
    kind, severity, body = out.read_text().split("|", 2)
    assert (kind, severity) == ("oom-kill", "critical")
    assert json.loads(body)["message"] == ALERT.message


@pytest.mark.parametrize(
    "command", [f"{shlex.quote(sys.executable)} -c 'raise SystemExit(3)'", "/nonexistent/cmd"]
)
def test_failing_alert_command_is_counted(tmp_path: Path, command: str) -> None:
    sink = AlertSink(tmp_path / "alerts.jsonl", command=command)
    delivery = sink.emit(ALERT)
    assert sink.failures == 1
    assert delivery.command_exit == 3 or delivery.command_error


# ---------------------------------------------------------------- crash bundles


def _cgroup_dir(tmp_path: Path, version: int) -> Path:
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "cgroup.procs").write_text("")
    (cg / "memory.stat").write_text("anon 100\nfile 20\n")
    if version == 2:
        (cg / "memory.events").write_text("low 0\nhigh 3\nmax 2\noom 1\noom_kill 1\n")
        (cg / "memory.current").write_text("120\n")
    else:
        (cg / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
        (cg / "memory.failcnt").write_text("38\n")
    return cg


@pytest.mark.parametrize("version", [1, 2])
def test_bundle_contents(tmp_path: Path, version: int) -> None:
    kills = find_oom_kills(
        parse_records((FIXTURES / "oom-6.18-memcg-v1-captured.kmsg").read_text())
    )
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "worker.log").write_bytes(b"x" * (300 << 10) + b"\nFatal Python error: Aborted\n")
    (faults / "front.log").write_text("Thread 0x1 (most recent call first):\n")
    path = write_bundle(
        tmp_path / "crashes",
        BundleInputs(
            reason="oom-kill",
            kills=kills,
            cgroup_dir=_cgroup_dir(tmp_path, version),
            faults_dir=faults,
            governor={"level": "critical", "transitions": [{"from": "ok", "to": "shed"}]},
            health={"status": "ok"},
            unit="slmguard.service",
        ),
        unix_s=1_800_000_000,
        journal=lambda unit: f"-- journal of {unit} --\n",
    )
    assert path.name == "20270115T080000Z"
    report = (path / "oom-report.txt").read_text()
    assert "python3 invoked oom-killer" in report
    assert "Killed process 8957 (python3)" in report
    assert "oom_memcg=/process_api" in report
    assert "anon 100" in (path / "memory.stat").read_text()
    events = (path / "memory.events").read_text()
    assert "oom_kill 1" in events
    assert json.loads((path / "governor.json").read_text())["transitions"][0]["to"] == "shed"
    worker = (path / "faults" / "worker.log").read_bytes()
    assert worker.endswith(b"Fatal Python error: Aborted\n") and len(worker) == 256 << 10
    assert (path / "faults" / "front.log").exists()
    assert (path / "journal.txt").read_text() == "-- journal of slmguard.service --\n"
    summary = json.loads((path / "summary.json").read_text())
    assert summary["reason"] == "oom-kill"
    assert summary["kills"][0]["pid"] == 8957 and "lines" not in summary["kills"][0]
    assert "oom-report.txt" in summary["files"] and "journal.txt" in summary["files"]
    assert not list((tmp_path / "crashes").glob(".tmp-*"))


def test_bundle_without_optional_parts(tmp_path: Path) -> None:
    path = write_bundle(tmp_path / "crashes", BundleInputs("on-demand"), journal=lambda u: None)
    assert sorted(p.name for p in path.iterdir()) == ["summary.json"]


def test_bundles_in_the_same_second_get_distinct_dirs(tmp_path: Path) -> None:
    a = write_bundle(tmp_path, BundleInputs("x"), unix_s=0, journal=lambda u: None)
    b = write_bundle(tmp_path, BundleInputs("x"), unix_s=0, journal=lambda u: None)
    assert a != b and b.name == a.name + "-2"


def test_retention_by_count(tmp_path: Path) -> None:
    for i in range(6):
        write_bundle(tmp_path, BundleInputs(f"r{i}"), unix_s=i * 60, journal=lambda u: None)
    removed = prune_bundles(tmp_path, max_count=3, max_bytes=1 << 30)
    assert len(removed) == 3
    kept = [json.loads((b / "summary.json").read_text())["reason"] for b in list_bundles(tmp_path)]
    assert kept == ["r3", "r4", "r5"]


def test_retention_by_size_keeps_the_newest_even_if_alone_too_big(tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "worker.log").write_bytes(b"y" * (100 << 10))
    root = tmp_path / "crashes"
    for i in range(4):
        write_bundle(
            root, BundleInputs(f"r{i}", faults_dir=faults), unix_s=i * 60, journal=lambda u: None
        )
    prune_bundles(root, max_count=10, max_bytes=250 << 10)
    assert len(list_bundles(root)) == 2
    prune_bundles(root, max_count=10, max_bytes=1)
    (last,) = list_bundles(root)
    assert json.loads((last / "summary.json").read_text())["reason"] == "r3"


def test_unwritable_crash_dir_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "crashes"
    blocker.write_text("not a dir")
    with pytest.raises(HostReadError, match="cannot write crash bundle"):
        write_bundle(blocker, BundleInputs("x"), journal=lambda u: None)


def test_temporary_dirs_of_dead_writers_are_cleaned_whatever_their_age(tmp_path: Path) -> None:
    """By the writer's pid, not the directory's age: the wall clock may have jumped (a
    fresh leftover after a jump forward looked years old; an old one after a jump back,
    from the future)."""
    dead_pid = subprocess.Popen(["true"])  # a pid that has exited
    dead_pid.wait()
    stale = tmp_path / f".tmp-20200101T000000Z-{dead_pid.pid}"
    mine = tmp_path / f".tmp-20200101T000000Z-{os.getpid()}"  # a write under way
    for d in (stale, mine):
        d.mkdir()
    future = time.time() + 5 * 365 * 86400
    os.utime(stale, (future, future))
    prune_bundles(tmp_path, 5, 1 << 20)
    assert not stale.exists() and mine.exists()


def test_retention_follows_the_order_written_not_the_wall_clock(tmp_path: Path) -> None:
    """A board without an RTC: bundles written in 2026, then (after the clock went back
    to 1970) one more. The 1970 one is the newest: pruning keeps it, and the stall
    evidence picked is the newest written too (issue 40)."""
    for i in range(3):
        write_bundle(tmp_path, BundleInputs(f"r{i}"), unix_s=1.8e9 + i, journal=lambda u: None)
    write_bundle(tmp_path, BundleInputs("after-jump"), unix_s=86400, journal=lambda u: None)
    prune_bundles(tmp_path, max_count=2, max_bytes=1 << 30)
    kept = [json.loads((b / "summary.json").read_text())["reason"] for b in list_bundles(tmp_path)]
    assert kept == ["r2", "after-jump"]
    stalls = tmp_path / "stalls"
    stalls.mkdir()
    legacy = ("stall-1796512721490-7.json", "stall-1796512799999-6.json")  # earlier versions
    for name in (*legacy, "stall-000001-8.json", "stall-000002-9.json"):
        (stalls / name).write_text("{}")
    out = write_bundle(tmp_path / "c2", BundleInputs("stall", stalls_dir=stalls),
                       journal=lambda u: None)  # fmt: skip
    assert sorted(p.name for p in (out / "stalls").iterdir()) == [
        "stall-000001-8.json", "stall-000002-9.json", "stall-1796512799999-6.json"]  # fmt: skip


@pytest.mark.skipif(shutil.which("journalctl") is None, reason="no journalctl on this host")
def test_journal_tail_runs_journalctl() -> None:
    text = journal_tail("no-such-unit-xyz.service", lines=5)
    assert text is not None  # output, or the reason journalctl gave


# ---------------------------------------------------------------- the small HTTP client


def test_parse_response_content_length_and_chunked() -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: b\r\n\r\n{}trailing"
    assert parse_response(raw) == (200, {"content-length": "2", "x-a": "b"}, b"{}")
    chunked = (
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4\r\nabcd\r\n3;x=y\r\nefg\r\n0\r\n\r\n"
    )
    assert parse_response(chunked)[0::2] == (201, b"abcdefg")
    assert parse_response(b"HTTP/1.0 204 No Content\r\n\r\n")[0::2] == (204, b"")


@pytest.mark.parametrize(
    "raw",
    [b"", b"garbage", b"SMTP 220 hello\r\n\r\n", b"HTTP/1.1 abc\r\n\r\n",
     b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab"],
)  # fmt: skip
def test_parse_response_rejects_malformed(raw: bytes) -> None:
    with pytest.raises(ValueError):
        parse_response(raw)


def test_request_unsupported_scheme() -> None:
    with pytest.raises(ValueError, match="unsupported URL"):
        http_request("ftp://example/x")


def test_request_times_out_on_a_silent_server() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)  # accepts the connection in the kernel, never answers
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/health"
        with pytest.raises(OSError):
            http_request(url, timeout_s=0.3)


def test_request_round_trip_with_token_and_query() -> None:
    with recording_server({("POST", "/api/v1/context/trim?x=1"): (200, {"ok": True})}) as srv:
        status, body = http_request(
            srv.url + "/api/v1/context/trim?x=1", method="POST", payload={"keep_recent": 5},
            token="t0k",
        )  # fmt: skip
        (req,) = srv.requests
    assert (status, json.loads(body)) == (200, {"ok": True})
    assert req.body == {"keep_recent": 5} and req.headers["authorization"] == "Bearer t0k"
    assert req.headers["host"] == srv.url.removeprefix("http://")
