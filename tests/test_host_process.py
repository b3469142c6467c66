"""host.process: /proc/<pid>/status, limits, oom_score_adj (read and the one setter)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hostboards import RK3588_HARDENED
from hosttree import build_tree
from slmguard.errors import HostReadError
from slmguard.host import process

# Captured from this machine's /proc/self/status (python3, Linux 6.x), trimmed.
STATUS = (
    "Name:\tpython3\nUmask:\t0022\nState:\tR (running)\nTgid:\t4242\nPid:\t4242\n"
    "VmPeak:\t   41204 kB\nVmSize:\t   41204 kB\nVmRSS:\t   30772 kB\n"
    "RssAnon:\t   19148 kB\nRssFile:\t   11624 kB\nRssShmem:\t       0 kB\n"
    "Threads:\t1\nCpus_allowed:\t3\nCpus_allowed_list:\t0-1\n"
    "Mems_allowed_list:\t0\nvoluntary_ctxt_switches:\t1\n"
)


def test_status_rss_split_and_affinity() -> None:
    st = process.parse_status(STATUS)
    assert st.rss_bytes == 30772 * 1024
    assert (st.rss_anon_bytes, st.rss_file_bytes, st.rss_shmem_bytes) == (
        19148 * 1024,
        11624 * 1024,
        0,
    )
    assert st.private_bytes == 19148 * 1024  # anon + shmem; the mapped file is not private
    assert st.cpus_allowed == (0, 1)


def test_status_of_a_kernel_thread_and_an_old_kernel() -> None:
    kthread = process.parse_status("Name:\tkthreadd\nCpus_allowed_list:\t0-3\n")
    assert kthread.rss_bytes is None and kthread.private_bytes == 0
    assert kthread.cpus_allowed == (0, 1, 2, 3)
    # Before Linux 4.5 there is no Rss* split: VmRSS only.
    old = process.parse_status("VmRSS:\t100 kB\n")
    assert old.rss_bytes == 102400 and old.rss_anon_bytes is None and old.private_bytes == 0
    shmem = process.parse_status("RssAnon:\t10 kB\nRssShmem:\t5 kB\n")
    assert shmem.private_bytes == 15 * 1024


def test_status_truncated_and_garbled() -> None:
    cut = STATUS[: STATUS.index("RssFile") + 9]  # "RssFile:\t" with no number
    st = process.parse_status(cut)
    assert st.rss_anon_bytes == 19148 * 1024 and st.rss_file_bytes is None
    assert process.parse_status("VmRSS:\tlots kB\nnot a line\n\n") == process.ProcessStatus()


def test_read_status_from_a_tree_and_a_gone_process(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"proc/42/status": STATUS})
    st = process.read_status(root, 42)
    assert st is not None and st.rss_bytes == 30772 * 1024
    assert process.read_status(root, 43) is None


def test_read_status_of_this_process() -> None:
    st = process.read_status()
    assert st is not None and st.rss_bytes is not None and st.rss_bytes > 0
    assert set(st.cpus_allowed) == os.sched_getaffinity(0)


def test_oom_score_adj_read_from_a_tree(tmp_path: Path) -> None:
    root = build_tree(
        tmp_path, {"proc/7/oom_score_adj": "1000\n", "proc/8/oom_score_adj": "high\n"}
    )
    assert process.read_oom_score_adj(root, 7) == 1000
    assert process.read_oom_score_adj(root, 8) is None  # garbled
    assert process.read_oom_score_adj(root, 9) is None  # gone


def test_set_oom_score_adj_in_a_tree(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"proc/self/oom_score_adj": "0\n"})
    assert process.set_oom_score_adj(500, root) is True
    assert process.read_oom_score_adj(root) == 500


def test_set_oom_score_adj_denied_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="slmguard.host.process"):
        assert process.set_oom_score_adj(-500, tmp_path, who="the front") is False
    assert "the front keeps oom_score_adj unknown (setting -500" in caplog.text


def test_set_oom_score_adj_on_the_real_kernel() -> None:
    # In a child: raising the value is always allowed, and it must not stay on pytest.
    code = (
        "from slmguard.host.process import read_oom_score_adj, set_oom_score_adj\n"
        "before = read_oom_score_adj()\n"
        "assert before is not None\n"
        "target = min(1000, before + 100)\n"
        "assert set_oom_score_adj(target), 'raising must be allowed'\n"
        "print(read_oom_score_adj() == target)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "True"


def test_lowering_oom_score_adj_without_the_capability_is_one_info_line() -> None:
    """Lowering needs CAP_SYS_RESOURCE: an unprivileged front is told so in one INFO line,
    not a WARNING (every start by hand logged it as one). In a child that drops root
    (to nobody, which leaves no capability) when it is root, on the real kernel."""
    code = (
        "import logging, os, sys\n"
        "from slmguard.host.process import read_oom_score_adj, set_oom_score_adj\n"
        "logging.basicConfig(level=logging.DEBUG, format='%(levelname)s %(message)s',"
        " stream=sys.stdout)\n"
        "if os.geteuid() == 0:  # imported first: nobody may not read this Python's files\n"
        "    os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
        "before = read_oom_score_adj()\n"
        "assert before is not None and before > -1000\n"
        "assert not set_oom_score_adj(before - 1, who='the front'), 'lowering was allowed'\n"
        "assert read_oom_score_adj() == before\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (line,) = out.stdout.splitlines()
    assert line.startswith("INFO the front keeps oom_score_adj "), line
    assert "needs CAP_SYS_RESOURCE" in line and "OOMScoreAdjust=" in line


def test_commit_charge_is_the_private_writable_mappings(tmp_path: Path) -> None:
    maps = (
        "00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/dbus-daemon\n"
        "00651000-00652000 rw-p 00051000 08:02 173521 /usr/bin/dbus-daemon\n"
        "00e03000-00e24000 rw-p 00000000 00:00 0 [heap]\n"
        "7f0000000000-7f0000100000 rw-s 00000000 00:01 9 /dev/shm/ring\n"
        "7ffc0000-7ffc2000 ---p 00000000 00:00 0\n"
        "zzzz-7ffc2000 rw-p 00000000 00:00 0\n"
        "short\n"
    )
    assert process.parse_commit_bytes(maps) == 0x1000 + 0x21000
    (tmp_path / "proc/7").mkdir(parents=True)
    (tmp_path / "proc/7/maps").write_text(maps)
    assert process.read_commit_bytes(tmp_path, 7) == 0x22000
    assert process.read_commit_bytes(tmp_path, 8) is None  # gone


def test_commit_charge_of_this_process_is_most_of_its_private_data() -> None:
    charge = process.read_commit_bytes()
    status = Path("/proc/self/status").read_text()
    data_kb = int(
        next(line for line in status.splitlines() if line.startswith("VmData:")).split()[1]
    )
    assert charge is not None and 0 < charge <= data_kb * 1024 * 2


# ---------------------------------------------------------------- limits


def test_memlock_limits(tmp_path: Path) -> None:
    root = build_tree(tmp_path, RK3588_HARDENED)
    assert process.read_memlock_limit(root) == process.RLimit(8388608, 8388608)
    unlimited = process.parse_limits(
        "Limit                     Soft Limit           Hard Limit           Units\n"
        "Max locked memory         unlimited            unlimited            bytes\n"
        "Max open files            many                 1024                 files\n"
    )
    assert "Max open files" not in unlimited
    assert unlimited["Max locked memory"] == process.RLimit(None, None)


def test_memlock_missing_line(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"proc/self/limits": "Limit  Soft Limit\n"})
    with pytest.raises(HostReadError, match="Max locked memory"):
        process.read_memlock_limit(root)


def test_memlock_live() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    live = process.read_memlock_limit(Path("/"))
    assert live.soft == (None if soft == resource.RLIM_INFINITY else soft)
    assert live.hard == (None if hard == resource.RLIM_INFINITY else hard)


# ---------------------------------------------------------------- threads and kernel stack


def test_thread_states_from_a_tree(tmp_path: Path) -> None:
    task = "proc/4242/task"
    root = build_tree(tmp_path, {
        f"{task}/4242/stat": "4242 (llama-server) S 1 4242 4242 0 -1 4194560 0\n",
        f"{task}/4242/wchan": "do_epoll_wait",
        f"{task}/4250/stat": "4250 (ggml (w) 1) D 1 4242 4242 0 -1\n",  # comm with ") "
        f"{task}/4251/stat": "garbled",  # skipped, not an error
        "proc/4242/stack": "[<0>] do_epoll_wait+0x1/0x2\n",
    })  # fmt: skip
    states = process.read_thread_states(root, 4242)
    assert states == (
        process.ThreadState(4242, "llama-server", "S", "do_epoll_wait"),
        process.ThreadState(4250, "ggml (w) 1", "D", None),  # wchan unreadable: None
    )
    assert process.read_kernel_stack(root, 4242) == "[<0>] do_epoll_wait+0x1/0x2\n"
    assert process.read_thread_states(root, 999) == ()  # gone
    assert process.read_kernel_stack(root, 999) is None


def test_thread_states_of_this_process() -> None:
    states = process.read_thread_states(Path("/"), os.getpid())
    main = next(t for t in states if t.tid == os.getpid())
    assert main.state == "R"  # it is reading its own threads
    assert main.name == Path("/proc/self/comm").read_text(encoding="utf-8").strip()


def test_has_ended_reads_gone_and_zombie_from_a_tree(tmp_path: Path) -> None:
    root = build_tree(
        tmp_path,
        {
            "proc/7/stat": "7 (llama-server) S 1 7 7 0 -1 4194560 0 0\n",
            "proc/8/stat": "8 (llama server) Z 1 8 8 0 -1 4194560 0 0\n",
            "proc/9/stat": "garbled\n",
        },
    )
    assert process.has_ended(root, 7) is False  # sleeping: still running
    assert process.has_ended(root, 8) is True  # a zombie: its status not collected
    assert process.has_ended(root, 9) is True  # not a stat line: nothing runs there
    assert process.has_ended(root, 10) is True  # gone


def test_has_ended_on_the_real_kernel() -> None:
    child = subprocess.Popen(["sleep", "600"])
    try:
        assert process.has_ended(Path("/"), child.pid) is False
        child.kill()
        deadline = time.monotonic() + 60
        while not process.has_ended(Path("/"), child.pid):  # a zombie until collected
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
    assert process.has_ended(Path("/"), child.pid) is True
