"""host.cpu.usable_threads: the one default thread count (serve) honours cpu.max."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hosttree import build_tree
from slmguard import settings
from slmguard.host.cpu import read_cpu_facts, usable_threads

# Eight online CPUs, all allowed; the cgroup /svc below sets the quota.
EIGHT = {
    "sys/devices/system/cpu/online": "0-7\n",
    "proc/self/status": "Name:\tpython3\nCpus_allowed_list:\t0-7\n",
}


@pytest.mark.parametrize(
    ("version", "files"),
    [
        (
            2,
            {
                "proc/self/cgroup": "0::/svc\n",
                "proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                "sys/fs/cgroup/svc/cpu.max": "150000 100000\n",
            },
        ),
        (
            1,
            {
                "proc/self/cgroup": "4:cpu,cpuacct:/svc\n0::/\n",
                "proc/self/mountinfo": "31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup "
                "cgroup rw,cpu,cpuacct\n",
                "sys/fs/cgroup/cpu,cpuacct/svc/cpu.cfs_quota_us": "150000\n",
                "sys/fs/cgroup/cpu,cpuacct/svc/cpu.cfs_period_us": "100000\n",
            },
        ),
    ],
)
def test_a_quota_of_one_and_a_half_cpus_is_one_thread(
    tmp_path: Path, version: int, files: dict[str, str]
) -> None:
    root = build_tree(tmp_path, {**EIGHT, **files})
    assert read_cpu_facts(root).quota_cpus == 1.5
    assert usable_threads(root) == 1


def test_without_a_quota_every_allowed_cpu(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {**EIGHT, "proc/self/status": "Cpus_allowed_list:\t2-5\n"})
    assert usable_threads(root) == 4


def test_without_sysfs_the_affinity_mask(tmp_path: Path) -> None:
    assert usable_threads(tmp_path) == len(os.sched_getaffinity(0))


def test_serve_default_is_the_usable_count() -> None:
    live = usable_threads()
    assert settings.default_threads() == live == read_cpu_facts(Path("/")).usable_count
    assert 1 <= live <= len(os.sched_getaffinity(0))
