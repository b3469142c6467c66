"""A real OOM kill in a real child memory cgroup, seen by the watcher exactly once.

The kernel kills a process that allocates past a 32 MiB limit; the watcher must
report that one kill (pid and comm from the kernel log, confirmed by the
cgroup's oom_kill counter), nothing on the next poll, and nothing after its
own restart (the cursor and counter are persisted). Other tests on this shared
machine may cause OOM kills in their own cgroups at the same time, so every
assertion is about this test's cgroup.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from realcgroup import HOG, RealCgroup, memory_cgroup, unavailable_reason
from slmguard.watch.config import WatchConfig
from slmguard.watch.daemon import PollResult, Watcher
from waiting import scaled, wait_for

pytestmark = pytest.mark.cgroup

LIMIT = 32 << 20
COMM = "slmg-hog"


@pytest.fixture
def cgroup() -> Iterator[RealCgroup]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with memory_cgroup(LIMIT) as cg:
        yield cg


def _oom(cg: RealCgroup) -> int:
    """Run the hog in the cgroup until the kernel kills it; its pid."""
    proc = cg.popen([sys.executable, "-c", HOG, COMM, "256"])
    proc.communicate(timeout=scaled(120))
    assert proc.returncode == -9, f"hog was not OOM-killed (exit {proc.returncode})"
    return proc.pid


def _poll_until_kill(w: Watcher) -> PollResult:
    def killed() -> PollResult | None:
        result = w.poll()
        return result if result.decision.service_kills else None

    return wait_for(killed, 30, "the kill in the kernel log")


def test_real_oom_kill_reported_once_across_polls_and_restart(
    cgroup: RealCgroup, tmp_path: Path
) -> None:
    config = WatchConfig(state_dir=tmp_path / "state", cgroup=cgroup.path)
    with Watcher(config) as w:
        before = w.poll()
        assert before.decision.service_kills == ()
        assert before.snapshot.cgroup is not None
        assert before.snapshot.cgroup.oom_kill_count == 0
        assert before.snapshot.cgroup.version == cgroup.version

        pid = _oom(cgroup)
        result = _poll_until_kill(w)
        (kill,) = result.decision.service_kills
        assert (kill.pid, kill.comm) == (pid, COMM)
        assert kill.scope == "memcg"
        assert kill.task_memcg == cgroup.kernel_path
        assert kill.anon_rss_bytes is not None and 0 < kill.anon_rss_bytes <= LIMIT
        assert result.snapshot.cgroup is not None
        assert result.snapshot.cgroup.oom_kill_count == 1
        assert result.decision.level == 2
        kinds = [a.kind for a in result.decision.alerts]
        assert kinds.count("oom-kill") == 1
        assert "oom-counter" not in kinds  # the counter agrees with the kernel report

        assert result.bundle is not None
        report = (result.bundle / "oom-report.txt").read_text()
        assert f"Killed process {pid} ({COMM})" in report
        assert "invoked oom-killer" in report
        summary = json.loads((result.bundle / "summary.json").read_text())
        assert [k["pid"] for k in summary["kills"]] == [pid]
        assert (result.bundle / "memory.stat").exists()

        after = w.poll()
        assert after.decision.service_kills == ()
        assert not [a for a in after.decision.alerts if a.kind.startswith("oom")]

    # The watcher restarts: the persisted cursor and counter say "already reported".
    with Watcher(config) as w2:
        again = w2.poll()
        assert again.decision.service_kills == ()
        assert not [a for a in again.decision.alerts if a.kind in ("oom-kill", "oom-counter")]

    lines = [json.loads(x) for x in config.alert_log.read_text().splitlines()]
    mine = [a for a in lines if a["kind"] == "oom-kill" and a["facts"]["pid"] == pid]
    assert len(mine) == 1


def test_real_oom_once_cli_exit_codes(cgroup: RealCgroup, tmp_path: Path) -> None:
    state = tmp_path / "state"
    argv = [
        str(Path(sys.executable).parent / "slmguard"),
        "watch",
        "--once",
        "--json",
        "--cgroup",
        str(cgroup.path),
        "--state-dir",
        str(state),
    ]
    first = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert first.returncode in (0, 1), first.stderr  # 1 if other cgroups had kills
    pid = _oom(cgroup)

    def critical() -> subprocess.CompletedProcess[str] | None:
        r = subprocess.run(argv, capture_output=True, text=True, check=False)
        return r if r.returncode == 2 else None

    second = wait_for(critical, 60, "watch --once to report the kill (exit 2)")
    out = json.loads(second.stdout)
    assert out["level"] == "critical"
    assert {"pid": pid, "comm": COMM} in [
        {"pid": k["pid"], "comm": k["comm"]} for k in out["kills"]
    ]
    assert out["bundle"]
    third = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert third.returncode != 2
    assert all(k["pid"] != pid for k in json.loads(third.stdout)["kills"])


def test_daemon_loop_wakes_on_the_kernel_record(cgroup: RealCgroup, tmp_path: Path) -> None:
    """With an hour between polls, the kill is still handled: /dev/kmsg wakes the loop."""
    config = WatchConfig(
        state_dir=tmp_path / "state", cgroup=cgroup.path, interval_s=3600, min_interval_s=3600
    )
    polls: list[PollResult] = []
    first_poll = threading.Event()
    killed = threading.Event()
    with Watcher(config) as w:

        def on_poll(result: PollResult) -> None:
            polls.append(result)
            first_poll.set()
            if result.decision.service_kills:
                killed.set()
                w.stop()

        loop = threading.Thread(target=w.run, args=(on_poll,))
        loop.start()
        try:
            assert first_poll.wait(60)
            pid = _oom(cgroup)
            assert killed.wait(120), "the loop did not wake for the kernel's OOM report"
        finally:
            w.stop()
            loop.join(scaled(30))
    kills = [k for r in polls for k in r.decision.service_kills]
    assert [(k.pid, k.comm) for k in kills] == [(pid, COMM)]
    assert len(polls) == 2  # the start poll and the one the kernel record triggered
