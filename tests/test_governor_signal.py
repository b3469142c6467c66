"""Governor memory signal: v1 and v2 fixture trees, captured files, this process, a real limit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import realcgroup
from cgrouptrees import (
    DIRS,
    HIGH,
    INACTIVE_FILE,
    MAX,
    TREES,
    USAGE,
    V1_MOUNTINFO,
    V1_STAT,
    V2_MOUNTINFO,
    V2_STAT,
)
from hosttree import build_tree, copy_captured
from slmguard.errors import HostReadError
from slmguard.governor.signal import (
    MemorySignal,
    MemorySnapshot,
    sample_interval_s,
)
from slmguard.host import cgroup
from slmguard.host.process import parse_status

MIB = 1 << 20
WORKING_SET = USAGE - INACTIVE_FILE  # 200 MiB in both documented trees


def meminfo(
    available_mib: int = 3000, commit_limit_mib: int = 3200, committed_mib: int = 1600
) -> str:
    return (
        "MemTotal:        3987456 kB\n"
        "MemFree:         1000000 kB\n"
        f"MemAvailable:    {available_mib * 1024} kB\n"
        "Cached:           400000 kB\n"
        f"CommitLimit:     {commit_limit_mib * 1024} kB\n"
        f"Committed_AS:    {committed_mib * 1024} kB\n"
    )


HOST = {
    "proc/meminfo": meminfo(),
    "proc/sys/vm/overcommit_memory": "0\n",
    "proc/pressure/memory": (
        "some avg10=3.25 avg60=1.00 avg300=0.50 total=99\n"
        "full avg10=1.25 avg60=0.50 avg300=0.10 total=42\n"
    ),
}


def tree(tmp_path: Path, version: int, **extra: str) -> Path:
    return build_tree(tmp_path, {**TREES[version], **HOST, **extra})


@pytest.mark.parametrize("version", [1, 2])
def test_documented_tree(tmp_path: Path, version: int) -> None:
    root = tree(tmp_path, version)
    snap = MemorySignal(root, clock=lambda: 42.0).sample()
    assert snap.taken_s == 42.0
    assert snap.source == f"cgroup{version}"
    assert snap.cgroup_path == str(root / DIRS[version])
    assert snap.usage_bytes == USAGE
    # Inactive page cache (the cold part of the mapped model) is not pressure.
    assert snap.working_set_bytes == WORKING_SET
    assert (snap.limit_bytes, snap.limit_source) == (
        (HIGH, "memory.high") if version == 2 else (MAX, "memory.limit_in_bytes")
    )
    assert snap.used_pct == pytest.approx(100 * WORKING_SET / snap.limit_bytes)
    assert snap.headroom_bytes == snap.limit_bytes - WORKING_SET
    # v2 reads the cgroup's own PSI; v1 has none and falls back to the system's.
    assert snap.psi_some_avg10_pct == (1.5 if version == 2 else 3.25)
    assert snap.psi_full_avg10_pct == (0.5 if version == 2 else 1.25)
    assert snap.oom_kill_count == 1
    assert snap.mem_available_bytes == 3000 * MIB
    assert snap.overcommit_mode == 0
    assert snap.commit_used_pct is None  # only meaningful under mode 2
    as_dict = snap.as_dict()
    assert as_dict["working_set_bytes"] == WORKING_SET
    assert as_dict["limit_source"] == snap.limit_source


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    ("budget_mib", "plan_mib", "available_mib", "source", "limit"),
    [
        (1000, None, 3000, "budget", 1000 * MIB),
        (1000, 900, 3000, "plan", 900 * MIB),
        # Host nearly out of memory: working set + MemAvailable is the real bound.
        (1000, 900, 100, "mem_available", WORKING_SET + 100 * MIB),
    ],
)
def test_smallest_limit_wins(
    tmp_path: Path,
    version: int,
    budget_mib: int,
    plan_mib: int | None,
    available_mib: int,
    source: str,
    limit: int,
) -> None:
    root = tree(tmp_path, version, **{"proc/meminfo": meminfo(available_mib)})
    signal = MemorySignal(
        root,
        budget_bytes=budget_mib * MIB,
        plan_limit_bytes=None if plan_mib is None else plan_mib * MIB,
    )
    snap = signal.sample()
    assert (snap.limit_source, snap.limit_bytes) == (source, limit)


@pytest.mark.parametrize("version", [1, 2])
def test_unlimited_cgroup_falls_back_to_mem_available_and_plan(
    tmp_path: Path, version: int
) -> None:
    d = DIRS[version]
    unlimited = (
        {f"{d}/memory.high": "max\n", f"{d}/memory.max": "max\n"}
        if version == 2
        else {
            f"{d}/memory.limit_in_bytes": "9223372036854771712\n",
            f"{d}/memory.stat": TREES[1][f"{d}/memory.stat"].replace(
                f"hierarchical_memory_limit {MAX}", "hierarchical_memory_limit 9223372036854771712"
            ),
        }
    )
    root = tree(tmp_path, version, **unlimited)
    snap = MemorySignal(root).sample()
    assert (snap.limit_source, snap.limit_bytes) == ("mem_available", WORKING_SET + 3000 * MIB)
    snap = MemorySignal(root, plan_limit_bytes=2000 * MIB).sample()
    assert (snap.limit_source, snap.limit_bytes) == ("plan", 2000 * MIB)


def test_v1_ancestor_limit_applies(tmp_path: Path) -> None:
    d = DIRS[1]
    stat = TREES[1][f"{d}/memory.stat"].replace(
        f"hierarchical_memory_limit {MAX}", f"hierarchical_memory_limit {1500 * MIB}"
    )
    root = tree(tmp_path, 1, **{f"{d}/memory.stat": stat})
    snap = MemorySignal(root).sample()
    assert (snap.limit_source, snap.limit_bytes) == ("hierarchical_memory_limit", 1500 * MIB)


@pytest.mark.parametrize("version", [1, 2])
def test_commit_headroom_under_overcommit_mode_2(tmp_path: Path, version: int) -> None:
    root = tree(
        tmp_path,
        version,
        **{
            "proc/sys/vm/overcommit_memory": "2\n",
            "proc/meminfo": meminfo(commit_limit_mib=2000, committed_mib=1900),
        },
    )
    snap = MemorySignal(root).sample()
    assert snap.overcommit_mode == 2
    assert snap.commit_limit_bytes == 2000 * MIB
    assert snap.committed_as_bytes == 1900 * MIB
    assert snap.commit_used_pct == pytest.approx(95.0)


@pytest.mark.parametrize("version", [1, 2])
def test_missing_psi_and_sysctl_give_none(tmp_path: Path, version: int) -> None:
    files = {k: v for k, v in TREES[version].items() if not k.endswith("memory.pressure")}
    root = build_tree(tmp_path, {**files, "proc/meminfo": meminfo()})
    snap = MemorySignal(root).sample()
    assert snap.psi_some_avg10_pct is None and snap.psi_full_avg10_pct is None
    assert snap.overcommit_mode is None
    assert snap.working_set_bytes == WORKING_SET


def test_garbled_psi_is_dropped_not_fatal(tmp_path: Path) -> None:
    root = tree(tmp_path, 1, **{"proc/pressure/memory": "garbage\n"})
    signal = MemorySignal(root)
    assert signal.sample().psi_some_avg10_pct is None
    assert signal.sample().working_set_bytes == WORKING_SET


@pytest.mark.parametrize("version", [1, 2])
def test_garbled_usage_raises_naming_the_file(tmp_path: Path, version: int) -> None:
    name = cgroup.V2_CURRENT if version == 2 else cgroup.V1_USAGE
    root = tree(tmp_path, version, **{f"{DIRS[version]}/{name}": "lots\n"})
    with pytest.raises(HostReadError) as info:
        MemorySignal(root).sample()
    assert name in str(info.value)


def test_missing_meminfo_raises(tmp_path: Path) -> None:
    root = build_tree(tmp_path, TREES[2])
    with pytest.raises(HostReadError, match="meminfo"):
        MemorySignal(root).sample()


def test_without_memory_controller_sums_the_service_processes(tmp_path: Path) -> None:
    status = (
        "Name:\tpython\nVmRSS:\t  500000 kB\nRssAnon:\t  100000 kB\n"
        "RssFile:\t  390000 kB\nRssShmem:\t   10000 kB\n"
    )
    root = build_tree(
        tmp_path,
        {
            **HOST,
            "proc/self/cgroup": "0::/user.slice\n",
            "proc/self/mountinfo": "",
            "sys/fs/cgroup/cgroup.controllers": "cpu io pids\n",
            "proc/10/status": status,
            "proc/11/status": status,
        },
    )
    signal = MemorySignal(root, pids=lambda: [10, 11, 12])  # 12 has exited
    assert signal.cgroup_dir is None
    snap = signal.sample()
    assert snap.source == "processes"
    assert snap.working_set_bytes == 2 * 110_000 * 1024
    assert snap.usage_bytes is None and snap.cgroup_path is None
    assert snap.limit_source == "mem_available"


SERVICE_STATUS = (  # 110,000 kB private (anon + shmem) per process
    "Name:\tpython\nVmRSS:\t  500000 kB\nRssAnon:\t  100000 kB\n"
    "RssFile:\t  390000 kB\nRssShmem:\t   10000 kB\n"
)
HOST_WIDE = 1900 * MIB  # every process of the host, the service's 215 MiB among them
UNLIMITED_V1 = "9223372036854771712\n"

# A server started by hand where no manager gave it a cgroup of its own: it lives in
# the memory hierarchy's root. v1's root counts the whole host (and alone has
# cgroup.sane_behavior); v2's root has no memory.current at all.
ROOT_CGROUP = {
    1: {
        "proc/self/cgroup": "8:memory:/\n0::/\n",
        "proc/self/mountinfo": V1_MOUNTINFO,
        "sys/fs/cgroup/unified/cgroup.controllers": "",
        "sys/fs/cgroup/memory/cgroup.sane_behavior": "0\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{HOST_WIDE}\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": UNLIMITED_V1,
        "sys/fs/cgroup/memory/memory.stat": V1_STAT.replace(
            f"hierarchical_memory_limit {MAX}", "hierarchical_memory_limit 9223372036854771712"
        ),
        "sys/fs/cgroup/memory/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\n",
    },
    2: {
        "proc/self/cgroup": "0::/\n",
        "proc/self/mountinfo": V2_MOUNTINFO,
        "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma misc\n",
        "sys/fs/cgroup/cgroup.subtree_control": "cpuset cpu io memory pids\n",
        "sys/fs/cgroup/memory.stat": V2_STAT,
        "sys/fs/cgroup/memory.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=1\n",
    },
}


@pytest.mark.parametrize("version", [1, 2])
def test_root_cgroup_counts_the_service_processes_not_the_host(
    tmp_path: Path, version: int
) -> None:
    """In the hierarchy's root the cgroup's usage is not the service's: v1 counted
    every process of the host against the service's budget (another program's memory
    moved its watermarks), v2 read no usage at all (a blind governor at 0%)."""
    root = build_tree(
        tmp_path,
        {**ROOT_CGROUP[version], **HOST, "proc/10/status": SERVICE_STATUS,
         "proc/11/status": SERVICE_STATUS},
    )  # fmt: skip
    service = 2 * 110_000 * 1024
    signal = MemorySignal(root, budget_bytes=400 * MIB, pids=lambda: [10, 11])
    assert signal.cgroup_dir is None
    snap = signal.sample()
    assert snap.source == "processes"
    assert snap.working_set_bytes == service
    assert (snap.limit_source, snap.limit_bytes) == ("budget", 400 * MIB)
    assert snap.used_pct == pytest.approx(100 * service / (400 * MIB))
    # Without a budget the host's shortage still bounds it, through MemAvailable.
    unbounded = MemorySignal(root, pids=lambda: [10, 11]).sample()
    assert (unbounded.limit_source, unbounded.limit_bytes) == (
        "mem_available", service + 3000 * MIB
    )  # fmt: skip


@pytest.mark.parametrize("version", [1, 2])
def test_a_containers_own_cgroup_at_the_mount_root_is_counted(tmp_path: Path, version: int) -> None:
    """A container's cgroup seen through its cgroup namespace is ``/`` too, but it is
    the container's own (no cgroup.sane_behavior on v1, memory.current on v2)."""
    files = {k: v for k, v in ROOT_CGROUP[version].items() if "sane_behavior" not in k}
    mount = "sys/fs/cgroup/memory" if version == 1 else "sys/fs/cgroup"
    files[f"{mount}/memory.usage_in_bytes" if version == 1 else f"{mount}/memory.current"] = (
        f"{USAGE}\n"
    )
    files[f"{mount}/memory.limit_in_bytes" if version == 1 else f"{mount}/memory.max"] = f"{MAX}\n"
    root = build_tree(tmp_path, {**files, **HOST})
    snap = MemorySignal(root).sample()
    assert snap.source == f"cgroup{version}"
    assert snap.cgroup_path == str(root / mount)
    assert snap.working_set_bytes == WORKING_SET
    assert snap.limit_bytes == MAX


def test_live_root_cgroup_is_not_the_service() -> None:
    """This host's real memory hierarchy root counts more than its own (skipped where
    this process is in the root, or there is no memory controller)."""
    own = cgroup.memory_cgroup_dir(Path("/"))
    if own is None:
        pytest.skip("this host has no memory cgroup controller")
    top = own
    while cgroup.is_cgroup_dir(top.parent):
        top = top.parent
    if top == own:
        pytest.skip("this process lives in the memory hierarchy's root")
    assert cgroup.counts_own_memory(own)
    assert not cgroup.counts_own_memory(top)
    assert MemorySignal(Path("/")).sample().source in ("cgroup1", "cgroup2")


def test_captured_this_machine(tmp_path: Path) -> None:
    root = copy_captured("thismachine", tmp_path)
    snap = MemorySignal(root).sample()
    assert snap.source == "cgroup1"
    # The captured cgroup is unlimited: the host's MemAvailable bounds it.
    assert snap.limit_source == "mem_available"
    assert snap.working_set_bytes == 3289088 - 86016
    assert snap.psi_some_avg10_pct is not None


def test_status_parser() -> None:
    text = "RssAnon:\t     12 kB\nRssFile:\t 99 kB\nRssShmem:\t 3 kB\n"
    assert parse_status(text).private_bytes == 15 * 1024
    assert parse_status("Name: x\n").private_bytes == 0


def _snap(ws: int, limit: int | None) -> MemorySnapshot:
    return MemorySnapshot(0.0, "cgroup2", ws, limit, "memory.high")


@pytest.mark.parametrize(
    ("ws_mib", "limit_mib", "expected_s"),
    [
        (0, 1000, 0.830),  # 850 MiB to shed at 1 GiB/s
        (0, 5000, 1.0),  # 4250 MiB: capped at max
        (700, 1000, 0.1465),  # 150 MiB to the 85% watermark
        (845, 1000, 0.02),  # 5 MiB: floor at min
        (880, 1000, 0.039),  # above shed: next watermark is 92% (40 MiB)
        (990, 1000, 0.02),  # above every watermark: headroom to the limit
        (1100, 1000, 0.02),  # over the limit
        (100, None, 1.0),  # no limit: nothing to race against
    ],
)
def test_adaptive_interval(ws_mib: int, limit_mib: int | None, expected_s: float) -> None:
    interval = sample_interval_s(
        _snap(ws_mib * MIB, None if limit_mib is None else limit_mib * MIB),
        (85.0, 92.0, 97.0),
        fill_rate_bytes_per_s=1 << 30,
        min_s=0.02,
        max_s=1.0,
    )
    assert interval == pytest.approx(expected_s, rel=0.02)


def test_interval_shrinks_as_headroom_shrinks() -> None:
    intervals = [
        sample_interval_s(_snap(ws * MIB, 2600 * MIB), (85.0,), fill_rate_bytes_per_s=1 << 30)
        for ws in (500, 1000, 1500, 2000, 2200)
    ]
    assert intervals == sorted(intervals, reverse=True)
    assert intervals[0] == 1.0 and intervals[-1] < 0.05


def test_live_this_process_sees_its_own_allocation() -> None:
    """This process's real memory cgroup (v1 here): 64 MiB touched shows in the working set."""
    live = Path("/")
    if cgroup.memory_cgroup_dir(live) is None:
        pytest.skip("this host has no memory cgroup controller")
    signal = MemorySignal(live)
    before = signal.sample()
    assert before.source in ("cgroup1", "cgroup2")
    assert before.limit_bytes is not None and before.used_pct is not None
    block = bytearray(64 * MIB)
    for i in range(0, len(block), 4096):  # touch every page
        block[i] = 1
    after = signal.sample()
    del block
    # Other processes of this cgroup may free memory meanwhile; most of 64 MiB shows.
    assert after.working_set_bytes - before.working_set_bytes > 40 * MIB


HOLD = (
    "import sys\n"
    "b = bytearray(int(sys.argv[1]) << 20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
)


@pytest.mark.cgroup
def test_real_child_cgroup_limit_and_working_set() -> None:
    reason = realcgroup.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with realcgroup.memory_cgroup(128 * MIB, prefix="slmguard-governor") as cg:
        argv = cg.command([sys.executable, "-c", HOLD, "64"])
        pipe = subprocess.PIPE
        with subprocess.Popen(argv, stdin=pipe, stdout=pipe, text=True) as proc:
            try:
                assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
                snap = MemorySignal(Path("/"), cgroup_dir=cg.path).sample()
            finally:
                proc.kill()
    assert snap.source == f"cgroup{cg.version}"
    assert snap.limit_bytes == 128 * MIB
    assert snap.limit_source in ("memory.limit_in_bytes", "memory.max")
    assert 64 * MIB <= snap.working_set_bytes <= 128 * MIB
    assert snap.used_pct is not None and 50 <= snap.used_pct <= 100
