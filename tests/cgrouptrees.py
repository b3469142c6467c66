"""cgroup v1 and v2 fixture trees in the kernel's documented formats.

Both describe the same service (``system.slice/slm_inference.service``) using
300 MiB with 100 MiB inactive page cache, MemoryMax=2800M (and, on v2,
MemoryHigh=2600M), after one OOM kill. Formats follow
Documentation/admin-guide/cgroup-v2.rst (memory.stat, memory.events, "max")
and Documentation/admin-guide/cgroup-v1/memory.rst (memory.stat total_*,
memory.oom_control, the page-aligned LONG_MAX that means unlimited).
"""

from __future__ import annotations

MIB = 1024 * 1024
SERVICE = "system.slice/slm_inference.service"
USAGE = 300 * MIB
INACTIVE_FILE = 100 * MIB
HIGH = 2600 * MIB
MAX = 2800 * MIB

V2_DIR = f"sys/fs/cgroup/{SERVICE}"
V1_DIR = f"sys/fs/cgroup/memory/{SERVICE}"

V2_MOUNTINFO = (
    "22 1 179:2 / / rw,noatime shared:1 - ext4 /dev/mmcblk0p2 rw,commit=600\n"
    "23 22 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw\n"
    "25 22 0:22 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)

V2_STAT = (
    f"anon {190 * MIB}\nfile {110 * MIB}\nkernel 4194304\nkernel_stack 131072\n"
    "pagetables 1048576\nsec_pagetables 0\npercpu 0\nsock 0\nvmalloc 0\nshmem 0\n"
    "zswap 0\nzswapped 0\nfile_mapped 104857600\nfile_dirty 0\nfile_writeback 0\n"
    "swapcached 0\nanon_thp 0\nfile_thp 0\nshmem_thp 0\n"
    f"inactive_anon {190 * MIB}\nactive_anon 0\ninactive_file {INACTIVE_FILE}\n"
    f"active_file {10 * MIB}\nunevictable 0\nslab_reclaimable 0\nslab_unreclaimable 0\n"
    "slab 0\nworkingset_refault_anon 0\nworkingset_refault_file 12\npgfault 51234\n"
    "pgmajfault 3\n"
)

CGROUP_V2 = {
    "proc/self/cgroup": f"0::/{SERVICE}\n",
    "proc/self/mountinfo": V2_MOUNTINFO,
    "proc/1234/cgroup": f"0::/{SERVICE}\n",
    "proc/1234/mountinfo": V2_MOUNTINFO,
    "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma misc\n",
    "sys/fs/cgroup/cgroup.subtree_control": "cpuset cpu io memory pids\n",
    f"{V2_DIR}/cgroup.controllers": "cpu io memory pids\n",
    f"{V2_DIR}/memory.current": f"{USAGE}\n",
    f"{V2_DIR}/memory.high": f"{HIGH}\n",
    f"{V2_DIR}/memory.max": f"{MAX}\n",
    f"{V2_DIR}/memory.events": "low 0\nhigh 17\nmax 4\noom 1\noom_kill 1\noom_group_kill 0\n",
    f"{V2_DIR}/memory.stat": V2_STAT,
    f"{V2_DIR}/memory.pressure": (
        "some avg10=1.50 avg60=0.75 avg300=0.20 total=812345\n"
        "full avg10=0.50 avg60=0.25 avg300=0.05 total=212345\n"
    ),
}

V1_MOUNTINFO = (
    "22 1 179:2 / / rw,noatime shared:1 - ext4 /dev/mmcblk0p2 rw\n"
    "24 22 0:20 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755\n"
    "30 24 0:26 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - "
    "cgroup2 cgroup2 rw,nsdelegate\n"
    "31 24 0:27 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:11 - "
    "cgroup cgroup rw,xattr,name=systemd\n"
    "35 24 0:31 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:15 - "
    "cgroup cgroup rw,memory\n"
    "36 24 0:32 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:16 - "
    "cgroup cgroup rw,cpu,cpuacct\n"
)

V1_PROC_CGROUP = (
    "12:pids:/system.slice/slm_inference.service\n"
    f"8:memory:/{SERVICE}\n"
    "4:cpu,cpuacct:/system.slice/slm_inference.service\n"
    "1:name=systemd:/system.slice/slm_inference.service\n"
    "0::/system.slice/slm_inference.service\n"
)

V1_STAT = (
    f"cache {110 * MIB}\nrss {190 * MIB}\nrss_huge 0\nshmem 0\nmapped_file {100 * MIB}\n"
    "dirty 0\nwriteback 0\nswap 0\npgpgin 80000\npgpgout 3000\npgfault 51234\n"
    f"pgmajfault 3\ninactive_anon {190 * MIB}\nactive_anon 0\n"
    f"inactive_file {INACTIVE_FILE}\nactive_file {10 * MIB}\nunevictable 0\n"
    f"hierarchical_memory_limit {MAX}\nhierarchical_memsw_limit 9223372036854771712\n"
    f"total_cache {110 * MIB}\ntotal_rss {190 * MIB}\n"
    f"total_inactive_anon {190 * MIB}\ntotal_active_anon 0\n"
    f"total_inactive_file {INACTIVE_FILE}\ntotal_active_file {10 * MIB}\n"
    "total_unevictable 0\n"
)

CGROUP_V1 = {
    "proc/self/cgroup": V1_PROC_CGROUP,
    "proc/self/mountinfo": V1_MOUNTINFO,
    "proc/1234/cgroup": V1_PROC_CGROUP,
    "proc/1234/mountinfo": V1_MOUNTINFO,
    "sys/fs/cgroup/unified/cgroup.controllers": "",
    f"{V1_DIR}/memory.usage_in_bytes": f"{USAGE}\n",
    f"{V1_DIR}/memory.limit_in_bytes": f"{MAX}\n",
    f"{V1_DIR}/memory.soft_limit_in_bytes": "9223372036854771712\n",
    f"{V1_DIR}/memory.failcnt": "4\n",
    f"{V1_DIR}/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
    f"{V1_DIR}/memory.stat": V1_STAT,
}

TREES = {1: CGROUP_V1, 2: CGROUP_V2}
DIRS = {1: V1_DIR, 2: V2_DIR}
