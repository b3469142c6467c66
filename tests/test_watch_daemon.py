"""The watcher on fixture host trees (cgroup v1 and v2), the trim call, the loop, the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cgrouptrees import DIRS, INACTIVE_FILE, TREES, USAGE
from hosttree import build_tree
from slmguard.cli import main as cli_main
from slmguard.host import cgroup as cg
from slmguard.host import dmabuf
from slmguard.host.process import parse_fdinfo_dmabuf, read_fd_counts
from slmguard.host.snapshot import collect
from slmguard.watch.config import WatchConfig
from slmguard.watch.daemon import PollResult, Watcher, next_interval_s
from slmguard.watch.sources import Collector
from slmguard.watch.state import WatchState, save_state
from waiting import scaled, wait_for
from watchhttp import recording_server

FIXTURES = Path(__file__).parent / "fixtures" / "kmsg"
SLMGUARD = str(Path(sys.executable).parent / "slmguard")
MIB = 1 << 20
MEMINFO = (
    "MemTotal:        4018000 kB\nMemFree:          900000 kB\nMemAvailable:    2000000 kB\n"
    "CmaTotal:          65536 kB\nCmaFree:           60000 kB\n"
)
PSI = (
    "some avg10=0.00 avg60=0.00 avg300=0.00 total=1\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
)
SERVICE_KERNEL_PATH = "/system.slice/slm_inference.service"


def host_root(tmp_path: Path, version: int, kmsg: str = "", **extra: str | None) -> Path:
    """A fixture host: the doctor helper's cgroup tree plus what the watcher reads."""
    tree: dict[str, str | bytes | None] = dict(TREES[version])
    base = "sys/fs/cgroup/memory" if version == 1 else "sys/fs/cgroup"
    tree.update(
        {
            f"{DIRS[version]}/cgroup.procs": "",
            # cgroup.procs marks the directories of the hierarchy up to its root
            f"{base}/cgroup.procs": "",
            f"{base}/system.slice/cgroup.procs": "",
            "proc/meminfo": MEMINFO,
            "proc/pressure/memory": PSI,
            "proc/sys/kernel/random/boot_id": "boot-1\n",
            "dev/kmsg": kmsg,
        }
    )  # fmt: skip
    tree.update(extra)
    return build_tree(tmp_path / "root", tree)


def config(root: Path, version: int, tmp_path: Path, **kw: Any) -> WatchConfig:
    return WatchConfig(root=root, state_dir=tmp_path / "state", cgroup=root / DIRS[version], **kw)


def kmsg_text(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize("version", [1, 2])
def test_kernel_path_and_unit_lookup(tmp_path: Path, version: int) -> None:
    root = host_root(tmp_path, version)
    assert cg.kernel_path(root / DIRS[version]) == SERVICE_KERNEL_PATH
    assert cg.unit_cgroup_dir(root, "slm_inference.service") == root / DIRS[version]
    assert cg.unit_cgroup_dir(root, "other.service") is None
    assert cg.kernel_path(tmp_path) is None


@pytest.mark.parametrize("version", [1, 2])
def test_poll_on_fixture_tree_reports_the_service_kill_once(tmp_path: Path, version: int) -> None:
    root = host_root(tmp_path, version, kmsg_text("oom-5.10-memcg-v2.kmsg"))
    cfg = config(root, version, tmp_path)
    with Watcher(cfg) as w:
        first = w.poll()
        snap, d = first.snapshot, first.decision
        assert snap.cgroup is not None and snap.cgroup.version == version
        assert d.working_set_bytes == USAGE - INACTIVE_FILE
        assert snap.cma_total_bytes == 65536 * 1024
        assert [k.pid for k in d.service_kills] == [4242]
        assert d.level == 2 and first.bundle is not None
        assert "Killed process 4242" in (first.bundle / "oom-report.txt").read_text()
        assert w.poll().decision.service_kills == ()
    state = json.loads(cfg.state_file.read_text())
    assert (state["boot_id"], state["kmsg_seq"]) == ("boot-1", 1223)
    assert state["oom_kill_counts"] == {str(root / DIRS[version]): 1}
    with Watcher(cfg) as w:
        again = w.poll()
        assert again.decision.service_kills == () and again.decision.alerts == ()


def test_new_boot_rereads_the_buffer(tmp_path: Path) -> None:
    root = host_root(tmp_path, 2, kmsg_text("oom-5.10-memcg-v2.kmsg"))
    cfg = config(root, 2, tmp_path)
    with Watcher(cfg) as w:
        assert len(w.poll().decision.service_kills) == 1
    (root / "proc/sys/kernel/random/boot_id").write_text("boot-2\n")
    with Watcher(cfg) as w:
        assert len(w.poll().decision.service_kills) == 1  # same seq numbers, new boot


def test_restart_in_the_middle_of_a_report_reads_it_whole(tmp_path: Path) -> None:
    full = kmsg_text("oom-5.10-memcg-v2.kmsg").splitlines(keepends=True)
    cut = next(i for i, line in enumerate(full) if line.startswith("6,1215,"))
    root = host_root(tmp_path, 2, "".join(full[:cut]))
    cfg = config(root, 2, tmp_path)
    with Watcher(cfg) as w:
        assert w.poll().decision.service_kills == ()
        w.save()
    assert json.loads(cfg.state_file.read_text())["kmsg_seq"] == 1200  # before the report
    with (root / "dev/kmsg").open("a") as fh:
        fh.write("".join(full[cut:]))
    with Watcher(cfg) as w:
        (kill,) = w.poll().decision.service_kills
    assert kill.invoked_by == "llama-server" and kill.lines[0].endswith("oom_score_adj=500")


YEAR_S = 365 * 86400


@pytest.mark.parametrize(
    "jump_s", [-56 * YEAR_S, 5 * YEAR_S], ids=["back-to-1970", "forward-5-years"]
)
def test_the_trim_cooldown_survives_a_wall_clock_jump_across_a_restart(
    tmp_path: Path, jump_s: float
) -> None:
    """A board without an RTC boots in the past and jumps at NTP sync (issue 40): the
    watcher restarted after the jump still counts its trim cooldown (CLOCK_BOOTTIME within
    the boot), neither trimming again at once nor never again."""
    token = tmp_path / "admin.token"
    token.write_text("s3cret\n")
    routes = {
        ("GET", "/health"): (200, {"status": "ok"}),
        ("POST", "/api/v1/context/trim"): (200, {"keep_recent": 128}),
    }
    root = host_root(tmp_path, 2)
    boot = [1000.0]  # CLOCK_BOOTTIME as the test moves it
    with recording_server(routes) as srv:
        cfg = config(root, 2, tmp_path, server_url=srv.url, admin_token_file=token,
                     warn_pct=5.0, sustain_s=0.0, trim_cooldown_s=3600.0)  # fmt: skip
        with Watcher(cfg, boottime=lambda: boot[0]) as w:
            assert w.poll().trim is not None
        boot[0] += 60.0  # a minute later, the wall clock has jumped
        jumped = Watcher(cfg, wall=lambda: time.time() + jump_s, boottime=lambda: boot[0])
        with jumped as w:
            assert w.poll().trim is None  # still in the cooldown
        boot[0] += 3600.0
        with Watcher(cfg, wall=lambda: time.time() + jump_s, boottime=lambda: boot[0]) as w:
            assert w.poll().trim is not None  # and it ends when it should
        assert len(srv.calls("POST", "/api/v1/context/trim")) == 2


def test_after_a_reboot_the_cooldown_falls_back_to_the_wall_clock(tmp_path: Path) -> None:
    """CLOCK_BOOTTIME restarts with the boot: across a reboot only the wall time says how
    long ago the last trim was (and a jump then merely ends the cooldown early)."""
    root = host_root(tmp_path, 2)
    cfg = config(root, 2, tmp_path, trim_cooldown_s=3600.0)
    save_state(cfg.state_file, WatchState(boot_id="boot-0", last_trim_unix_s=time.time() - 60,
                                          last_trim_boot_s=5.0))  # fmt: skip
    with Watcher(cfg, boottime=lambda: 1.0) as w:
        assert w.state.last_trim_boot_s is None
        assert w.rule_state.last_trim_s is not None  # 60 s ago by the wall clock
        assert time.monotonic() - w.rule_state.last_trim_s == pytest.approx(60, abs=5)


@pytest.mark.parametrize("version", [1, 2])
def test_trim_call_with_admin_token_once_per_cooldown(tmp_path: Path, version: int) -> None:
    token = tmp_path / "admin.token"
    token.write_text("s3cret\n")
    routes = {
        ("GET", "/health"): (200, {"status": "ok"}),
        ("GET", "/api/v1/governor"): (200, {"level": "ok", "transitions": []}),
        ("POST", "/api/v1/context/trim"): (200, {"keep_recent": 128, "trimmed": 3}),
    }
    root = host_root(tmp_path, version)
    with recording_server(routes) as srv:
        cfg = config(
            root, version, tmp_path,
            server_url=srv.url, admin_token_file=token, warn_pct=5.0,
            sustain_s=0.0, trim_cooldown_s=3600.0, keep_recent=128,
        )  # fmt: skip
        with Watcher(cfg) as w:
            result = w.poll()
            assert result.trim is not None and result.trim.ok
            assert result.trim.body == {"keep_recent": 128, "trimmed": 3}
            assert w.poll().trim is None  # cooldown
        with Watcher(cfg) as w:
            assert w.poll().trim is None  # the cooldown survives a restart
        (call,) = srv.calls("POST", "/api/v1/context/trim")
        gov = srv.calls("GET", "/api/v1/governor")
    assert call.body == {"keep_recent": 128}
    assert call.headers["authorization"] == "Bearer s3cret"
    assert gov and gov[0].headers["authorization"] == "Bearer s3cret"
    assert result.snapshot.governor is not None and result.snapshot.governor.ok
    alerts = [json.loads(x) for x in cfg.alert_log.read_text().splitlines()]
    assert [a["kind"] for a in alerts].count("trim") == 1


def test_trim_refused_by_server_is_a_warning_alert(tmp_path: Path) -> None:
    routes = {
        ("GET", "/health"): (200, {"status": "ok"}),
        ("POST", "/api/v1/context/trim"): (401, {"error": {"message": "bad token"}}),
    }
    root = host_root(tmp_path, 2)
    with recording_server(routes) as srv:
        cfg = config(root, 2, tmp_path, server_url=srv.url, warn_pct=5.0, sustain_s=0.0)
        with Watcher(cfg) as w:
            result = w.poll()
    assert result.trim is not None and result.trim.status == 401
    trim_alert = next(
        json.loads(x) for x in cfg.alert_log.read_text().splitlines() if '"trim"' in x
    )
    assert trim_alert["severity"] == "warning" and "HTTP 401" in trim_alert["message"]


def test_server_unhealthy_then_gone(tmp_path: Path) -> None:
    routes = {
        ("GET", "/health"): (200, {"state": "ready"}),
        ("GET", "/api/v1/governor"): (200, {"level": "shed"}),
    }
    root = host_root(tmp_path, 2)
    cfg = config(root, 2, tmp_path, http_timeout_s=scaled(5))
    with recording_server(routes) as srv:
        cfg = config(root, 2, tmp_path, server_url=srv.url, http_timeout_s=scaled(5))
        w = Watcher(cfg)
        assert w.poll().decision.level == 0
        srv.routes[("GET", "/health")] = (503, {"state": "restarting"})
        degraded = w.poll()
    gone = w.poll()  # the server is shut down now
    w.close()
    assert degraded.decision.level == 1 and degraded.bundle is None
    assert [a.kind for a in degraded.decision.alerts] == ["server-unhealthy"]
    assert "restarting" in degraded.decision.alerts[0].message
    assert gone.decision.level == 2 and gone.bundle is not None
    assert [a.kind for a in gone.decision.alerts] == ["server-down", "recovered"]
    assert json.loads((gone.bundle / "summary.json").read_text())["reason"] == "server-down"


def test_fd_and_dmabuf_counts_from_fixture_fdinfo(tmp_path: Path) -> None:
    root = build_tree(
        tmp_path,
        {
            "proc/77/comm": "llama-worker\n",
            "proc/77/stat": "77 (llama (worker)) S 1 77 77 0 -1 4194560 0\n",
            "proc/79/comm": "dead\n",
            "proc/79/stat": "79 (dead) Z 1 79 79 0 -1 4227084 0\n",
            "proc/79/fd": None,
            "proc/77/fd/0": "",
            "proc/77/fd/1": "",
            "proc/77/fd/dmabuf-5": "",
            "proc/77/fd/dmabuf-6": "",
            "proc/77/fdinfo/dmabuf-5": "pos:\t0\nflags:\t02\nmnt_id:\t9\nino:\t1\n"
            "size:\t8388608\ncount:\t2\nexp_name:\trknpu\nname:\tkv\n",
            "proc/77/fdinfo/dmabuf-6": "pos:\t0\nflags:\t02\nsize:\t4096\nexp_name:\tsystem\n",
            "sys/kernel/dmabuf/buffers/11/size": "8388608\n",
            "sys/kernel/dmabuf/buffers/12/size": "4096\n",
        },
    )
    counts = read_fd_counts(root, 77)
    assert counts is not None
    assert (counts.comm, counts.fd_count, counts.dmabuf_count) == ("llama-worker", 4, 2)
    assert counts.dmabuf_bytes == 8388608 + 4096
    assert read_fd_counts(root, 78) is None  # gone
    assert read_fd_counts(root, 79) is None  # a zombie has exited
    snap = Collector(root, pids=(77,)).read()
    assert (snap.system_dmabuf_count, snap.system_dmabuf_bytes) == (2, 8388608 + 4096)
    assert (snap.dmabuf_count, snap.fd_count) == (2, 4)


def test_dmabuf_parsers() -> None:
    assert parse_fdinfo_dmabuf("pos:\t0\nflags:\t02\n") is None
    assert parse_fdinfo_dmabuf("size:\t4096\nexp_name:\tsystem-heap\n") == 4096
    bufinfo = (
        "\nDma-buf Objects:\nsize flags mode count exp_name\n...\n\nTotal 3 objects, 12288 bytes\n"
    )
    assert dmabuf.parse_bufinfo(bufinfo) == (3, 12288)
    with pytest.raises(ValueError):
        dmabuf.parse_bufinfo("garbage")


def test_watch_and_doctor_report_one_dmabuf_total(tmp_path: Path) -> None:
    # Both sources on one board, disagreeing (a buffer freed between the reads):
    # the watcher and the doctor take the same one, debugfs.
    root = build_tree(
        tmp_path,
        {
            "sys/kernel/debug/dma_buf/bufinfo": "size flags mode count exp_name\n"
            "00008388608 00000002 00080005 00000001 rknpu\n\nTotal 1 objects, 8388608 bytes\n",
            "sys/kernel/dmabuf/buffers/11/size": "8388608\n",
            "sys/kernel/dmabuf/buffers/12/size": "4096\n",
        },
    )
    snap = Collector(root).read()
    audited = collect(root).dmabuf
    assert isinstance(audited, dmabuf.DmaBufTotals)
    assert (snap.system_dmabuf_count, snap.system_dmabuf_bytes) == (1, 8388608)
    assert (audited.count, audited.total_bytes) == (1, 8388608)
    # Neither source (no debugfs access, no sysfs stats): no total, and no error line.
    bare = Collector(tmp_path / "bare").read()
    assert bare.system_dmabuf_bytes is None
    assert not [e for e in bare.errors if "dma" in e]


def test_fd_count_of_a_real_process(tmp_path: Path) -> None:
    counts = read_fd_counts(Path("/"), os.getpid())
    assert counts is not None and counts.fd_count >= 3
    with open(tmp_path / "f", "w"), open(tmp_path / "g", "w"):
        more = read_fd_counts(Path("/"), os.getpid())
        assert more is not None and more.fd_count == counts.fd_count + 2


def test_next_interval() -> None:
    kw = {"base_s": 5.0, "min_s": 0.5, "warn_pct": 85.0}
    assert next_interval_s(None, None, 0, **kw) == 5.0
    assert next_interval_s(100 * MIB, 1000 * MIB, 0, **kw) == 5.0
    assert next_interval_s(900 * MIB, 1000 * MIB, 0, **kw) == 1.25
    # 100 MiB left, growing 50 MiB/s: limit in 2 s -> poll every 0.5 s
    assert next_interval_s(900 * MIB, 1000 * MIB, 50 * MIB, **kw) == 0.5
    assert next_interval_s(100 * MIB, 1000 * MIB, 100 * MIB, **kw) == 2.25


def test_loop_stops_cleanly_from_another_thread(tmp_path: Path) -> None:
    root = host_root(tmp_path, 2)
    cfg = config(root, 2, tmp_path, interval_s=0.05, min_interval_s=0.05)
    polls: list[PollResult] = []
    with Watcher(cfg) as w:

        def on_poll(r: PollResult) -> None:
            polls.append(r)
            if len(polls) == 3:
                w.stop()

        t = threading.Thread(target=w.run, args=(on_poll,))
        t.start()
        t.join(scaled(30))
        assert not t.is_alive()
    assert len(polls) == 3
    assert cfg.state_file.exists()  # saved on the way out


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (SigCgt in proc(5))."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(
        int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")
    )
    return bool(mask & (1 << (sig - 1)))


def _sleeps_in_poll(pid: int) -> bool:
    """Whether process ``pid``'s main thread is blocked in poll(2) (proc(5) wchan)."""
    try:
        return "poll" in Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False


def test_daemon_sigterm_saves_state_and_exits_0(tmp_path: Path) -> None:
    """The real daemon on the real /dev/kmsg: SIGTERM ends it at once with exit 0.

    It waits for the daemon's SIGTERM handler to be installed and its first poll
    done (the loop then sleeps in poll(2) until the next one), never for the 30 s
    poll interval: the state, with the kernel log position, is saved on the way out.
    """
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [SLMGUARD, "watch", "--state-dir", str(state), "--interval", "30", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: (
                (_catches(proc.pid, signal.SIGTERM) and _sleeps_in_poll(proc.pid))
                or proc.poll() is not None
            ),
            30,
            "the daemon's SIGTERM handler and first poll",
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=scaled(30))
    assert proc.returncode == 0, err
    saved = json.loads((state / "watch-state.json").read_text())
    assert saved["kmsg_seq"] is not None


# ---------------------------------------------------------------- CLI table


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        cli_main(args)
    out, err = capsys.readouterr()
    code = exc.value.code
    return (code if isinstance(code, int) else 1), out, err


@pytest.mark.parametrize(
    ("extra", "kmsg", "code", "needles"),
    [
        ([], "", 0, ["slmguard watch: healthy", "working set 200 MiB of 2600 MiB"]),
        (["--warn-pct", "5"], "", 1, ["warning: memory-high", "working set at 8%"]),
        (["--warn-pct", "5", "--critical-pct", "6"], "", 2, ["critical: memory-critical"]),
        ([], "oom-5.10-memcg-v2.kmsg", 2, ["critical: oom-kill", "llama-server (pid 4242)"]),
        ([], "oom-4.14-task-in.kmsg", 2, ["host-oom-kill", "java (pid 812)"]),
        (["--json"], "oom-5.10-memcg-v2.kmsg", 2, ['"level": "critical"', '"pid": 4242']),
        (["--json"], "", 0, ['"level": "healthy"', '"cma_total_bytes": 67108864']),
    ],
)
def test_cli_once_table(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    kmsg: str,
    code: int,
    needles: list[str],
) -> None:
    root = host_root(tmp_path, 2, kmsg_text(kmsg) if kmsg else "")
    args = ["watch", "--once", "--root", str(root), "--state-dir", str(tmp_path / "s")]
    args += ["--cgroup", str(root / DIRS[2]), *extra]
    got, out, err = run_cli(args, capsys)
    assert got == code, out + err
    for needle in needles:
        assert needle in out


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["--interval", "0"], 78, "--interval and --min-interval must be > 0"),
        (["--warn-pct", "90", "--critical-pct", "80"], 78, "--warn-pct <= --critical-pct"),
        (["--cgroup", "/nonexistent/cg"], 64, "not a cgroup directory"),
        (["--plan", "/nonexistent/plan.json"], 78, "plan file not found"),
        (["--interval", "abc"], 64, "invalid float value"),
        (["--once", "--collect"], 64, "not allowed with argument"),
    ],
)
def test_cli_errors_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], code: int, needle: str
) -> None:
    root = host_root(tmp_path, 2)
    got, _out, err = run_cli(
        ["watch", "--once", "--root", str(root), "--state-dir", str(tmp_path / "s"), *args]
        if "--collect" not in args
        else ["watch", "--root", str(root), *args],
        capsys,
    )
    assert got == code
    assert needle in err


def test_cli_unit_and_plan_set_cgroup_and_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from slmguard.plan.planfile import dumps_plan
    from test_plan_schema import _plan

    plan = tmp_path / "plan.json"
    plan.write_text(dumps_plan(_plan()))  # watermarks: shed 85, critical 97
    root = host_root(tmp_path, 1)
    args = ["watch", "--once", "--json", "--root", str(root), "--state-dir", str(tmp_path / "s")]
    got, out, _ = run_cli([*args, "--unit", "slm_inference.service", "--plan", str(plan)], capsys)
    data = json.loads(out)
    assert got == 0 and data["cgroup"] == str(root / DIRS[1])
    assert data["limit_bytes"] == 2800 * MIB  # v1 limit_in_bytes beats the plan fallback


def test_unit_that_comes_and_goes_is_followed(tmp_path: Path) -> None:
    root = host_root(tmp_path, 2)
    unit_dir = root / "sys/fs/cgroup/slmguard.slice/slmguard.service"
    cfg = WatchConfig(root=root, state_dir=tmp_path / "s", unit="slmguard.service")
    with Watcher(cfg) as w:
        before = w.poll()
        assert before.snapshot.service_present is False and before.decision.level == 1
        assert [a.kind for a in before.decision.alerts] == ["service-absent"]
        build_tree(unit_dir.parent, {"cgroup.procs": ""})  # the slice
        build_tree(
            unit_dir, {"cgroup.procs": "", "memory.current": "1000\n", "memory.max": "max\n"}
        )
        running = w.poll()
        assert running.snapshot.service_present is True
        assert running.snapshot.cgroup is not None and running.snapshot.cgroup.path == unit_dir
        assert w.service_cgroup == "/slmguard.slice/slmguard.service"
        for name in ("cgroup.procs", "memory.current", "memory.max"):
            (unit_dir / name).unlink()
        unit_dir.rmdir()
        gone = w.poll()
        assert gone.decision.level == 2  # it ran before: now it is down
        assert [a.kind for a in gone.decision.alerts] == ["service-absent"]


def test_cli_collect_for_a_stopped_unit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = host_root(tmp_path, 2)
    got, out, err = run_cli(
        ["watch", "--collect", "--root", str(root), "--state-dir", str(tmp_path / "s"),
         "--unit", "slmguard.service"],
        capsys,
    )  # fmt: skip
    assert got == 0, err
    assert (Path(out.strip()) / "summary.json").exists()


def test_cli_collect_prints_the_bundle_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The fixture's report, stamped "just now" on this boot's clock, after an old one.
    now_usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
    lines = []
    for line in kmsg_text("oom-5.10-memcg-v2.kmsg").splitlines(keepends=True):
        if line[0].isdigit():
            pri, seq, _ts, rest = line.split(",", 3)
            line = f"{pri},{seq},{now_usec},{rest}"
        lines.append(line)
    root = host_root(tmp_path, 2, "".join(lines))
    (tmp_path / "s" / "faults").mkdir(parents=True)
    (tmp_path / "s" / "faults" / "front.log").write_text("Fatal Python error: Segmentation fault\n")
    got, out, _ = run_cli(
        ["watch", "--collect", "--root", str(root), "--state-dir", str(tmp_path / "s"),
         "--cgroup", str(root / DIRS[2])],
        capsys,
    )  # fmt: skip
    assert got == 0
    bundle = Path(out.strip())
    assert bundle.parent == tmp_path / "s" / "crashes"
    summary = json.loads((bundle / "summary.json").read_text())
    assert summary["reason"] == "on-demand"
    assert "faults/front.log" in summary["files"] and "memory.events" in summary["files"]
    assert [k["pid"] for k in summary["kills"]] == [4242]
    assert "Killed process 4242" in (bundle / "oom-report.txt").read_text()
    assert not (tmp_path / "s" / "watch-state.json").exists()  # the cursor is untouched


def test_help_has_example(capsys: pytest.CaptureFixture[str]) -> None:
    got, out, _ = run_cli(["watch", "--help"], capsys)
    assert got == 0 and "Example:" in out and "--once" in out and "--root" not in out


def test_watch_imports_no_heavy_dependency(tmp_path: Path) -> None:
    """`slmguard watch` must run where the engine and the web stack are absent."""
    root = host_root(tmp_path, 2, kmsg_text("oom-5.10-memcg-v2.kmsg"))
    code = (
        "import sys, json\n"
        "from slmguard.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = {'numpy', 'gguf', 'fastapi', 'uvicorn', 'starlette', 'pydantic', 'httpx',\n"
        "         'llama_cpp', 'prometheus_client', 'ssl', 'email'}\n"
        "print(json.dumps(sorted(heavy & {m.split('.')[0] for m in sys.modules})))\n"
    )
    args = ["watch", "--once", "--json", "--root", str(root), "--state-dir", str(tmp_path / "s")]
    args += ["--cgroup", str(root / DIRS[2]), "--server", "http://127.0.0.1:9"]
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_unwritable_crash_dir_is_an_alert_not_a_crash(tmp_path: Path) -> None:
    root = host_root(tmp_path, 2, kmsg_text("oom-5.10-memcg-v2.kmsg"))
    cfg = config(root, 2, tmp_path)
    cfg.state_dir.mkdir()
    cfg.crash_dir.write_text("a file where the crashes directory should be")
    with Watcher(cfg) as w:
        result = w.poll()
    assert result.bundle is None and [k.pid for k in result.decision.service_kills] == [4242]
    kinds = [json.loads(x)["kind"] for x in cfg.alert_log.read_text().splitlines()]
    assert kinds.count("oom-kill") == 1 and kinds[-1] == "bundle-failed"
    assert json.loads(cfg.state_file.read_text())["kmsg_seq"] == 1223  # the kill is done
