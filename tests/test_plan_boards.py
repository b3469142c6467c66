"""Board detection and usable CPUs on fixture trees (real files under tmp_path)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slmguard.errors import HostReadError, UsageError
from slmguard.host.cpu import parse_cfs_v1, parse_cpu_max_v2, read_cpu_facts
from slmguard.plan.boards import (
    PROFILES,
    detect_board,
    family_from_device_tree,
    get_profile,
    pick_variant,
)

GIB_KB = 1024 * 1024


def _build(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
    return root


def _cpus(
    n: int, capacity: list[int] | None = None, freq: list[int] | None = None
) -> dict[str, str]:
    files: dict[str, str] = {"sys/devices/system/cpu/online": f"0-{n - 1}\n"}
    for i in range(n):
        if capacity:
            files[f"sys/devices/system/cpu/cpu{i}/cpu_capacity"] = f"{capacity[i]}\n"
        if freq:
            files[f"sys/devices/system/cpu/cpu{i}/cpufreq/cpuinfo_max_freq"] = f"{freq[i]}\n"
    return files


def _cgroup(version: int, quota: str | None, cpuset: str | None) -> dict[str, str]:
    """This process in cgroup /svc, with the CPU files of that version."""
    if version == 2:
        files = {
            "proc/self/cgroup": "0::/svc\n",
            "proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        }
        if quota is not None:
            files["sys/fs/cgroup/svc/cpu.max"] = quota + "\n"
        if cpuset is not None:
            files["sys/fs/cgroup/svc/cpuset.cpus.effective"] = cpuset + "\n"
        return files
    files = {
        "proc/self/cgroup": "4:cpu,cpuacct:/svc\n3:cpuset:/svc\n0::/\n",
        "proc/self/mountinfo": (
            "31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
            "32 25 0:28 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n"
        ),
    }
    if quota is not None:
        q, _, period = quota.partition(" ")
        files["sys/fs/cgroup/cpu,cpuacct/svc/cpu.cfs_quota_us"] = ("-1" if q == "max" else q) + "\n"
        files["sys/fs/cgroup/cpu,cpuacct/svc/cpu.cfs_period_us"] = (period or "100000") + "\n"
    if cpuset is not None:
        files["sys/fs/cgroup/cpuset/svc/cpuset.effective_cpus"] = cpuset + "\n"
    return files


def _meminfo(total_kb: int) -> str:
    return f"MemTotal:       {total_kb} kB\nMemAvailable:   {total_kb // 2} kB\n"


def _rk3588(total_kb: int) -> dict[str, str | bytes]:
    return {
        "proc/meminfo": _meminfo(total_kb),
        "proc/device-tree/model": b"Radxa ROCK 5B\x00",
        "proc/device-tree/compatible": b"radxa,rock-5b\x00rockchip,rk3588\x00",
        "proc/self/status": "Name:\tpython3\nCpus_allowed_list:\t0-7\n",
        **_cpus(8, capacity=[530] * 4 + [1024] * 4),
    }


@pytest.mark.parametrize(
    ("total_kb", "expected"),
    [(3_900_000, "rk3588-4g"), (7_900_000, "rk3588-8g"), (16 * GIB_KB - 200_000, "rk3588-16g")],
)
def test_rk3588_variants_by_memtotal(tmp_path: Path, total_kb: int, expected: str) -> None:
    b = detect_board(_build(tmp_path, _rk3588(total_kb)))
    assert b.name == expected
    assert b.ram_bytes == total_kb * 1024
    assert b.big_cores == (4, 5, 6, 7)
    assert b.cpus == tuple(range(8))
    assert b.max_threads == 8
    assert "rk3588" in b.detected_from and "cpu_capacity" in b.detected_from


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_quota_and_cpuset_limit_threads(tmp_path: Path, version: int) -> None:
    files = {**_rk3588(7_900_000), **_cgroup(version, "200000 100000", "2-7")}
    root = _build(tmp_path, files)
    cpu = read_cpu_facts(root)
    assert cpu.cpuset == (2, 3, 4, 5, 6, 7)
    assert cpu.quota_cpus == 2.0
    assert cpu.usable == (2, 3, 4, 5, 6, 7)
    assert cpu.usable_count == 2
    b = detect_board(root)
    assert b.big_cores == (4, 5, 6, 7) and b.max_threads == 2


@pytest.mark.parametrize("version", [1, 2])
def test_unlimited_quota_and_affinity(tmp_path: Path, version: int) -> None:
    files = {**_rk3588(7_900_000), **_cgroup(version, "max 100000", None)}
    files["proc/self/status"] = "Cpus_allowed_list:\t4-5\n"
    cpu = read_cpu_facts(_build(tmp_path, files))
    assert cpu.quota_cpus is None
    assert cpu.usable == (4, 5) and cpu.usable_count == 2
    assert detect_board(tmp_path).big_cores == (4, 5)


def test_pi5_by_model_and_cpufreq(tmp_path: Path) -> None:
    root = _build(
        tmp_path,
        {
            "proc/meminfo": _meminfo(8_000_000),
            "proc/device-tree/model": b"Raspberry Pi 5 Model B Rev 1.0\x00",
            "proc/self/status": "Cpus_allowed_list:\t0-3\n",
            **_cpus(4, freq=[2_400_000] * 4),
        },
    )
    b = detect_board(root)
    assert b.name == "rpi5-8g" and b.big_cores == (0, 1, 2, 3)
    assert "cpufreq" in b.detected_from


def test_jetson_by_compatible(tmp_path: Path) -> None:
    root = _build(
        tmp_path,
        {
            "proc/meminfo": _meminfo(3_800_000),
            "proc/device-tree/model": b"NVIDIA Jetson Orin Nano Developer Kit\x00",
            "proc/device-tree/compatible": b"nvidia,p3768-0000+p3767-0005\x00nvidia,tegra234\x00",
            **_cpus(6),
        },
    )
    b = detect_board(root)
    assert b.name == "jetson-orin-nano-4g"
    assert b.big_cores == tuple(range(6))  # no capacity, no cpufreq: all cores


def test_big_little_by_cpufreq_without_capacity(tmp_path: Path) -> None:
    files = _rk3588(3_900_000)
    for i in range(8):
        files.pop(f"sys/devices/system/cpu/cpu{i}/cpu_capacity")
    files.update(_cpus(8, freq=[1_800_000] * 4 + [2_352_000] * 4))
    assert detect_board(_build(tmp_path, files)).big_cores == (4, 5, 6, 7)


def test_generic_host_without_device_tree(tmp_path: Path) -> None:
    root = _build(
        tmp_path,
        {
            "proc/meminfo": _meminfo(24 * GIB_KB),
            "proc/cpuinfo": "processor\t: 0\nflags\t\t: fpu avx2\n",
            **_cpus(2, capacity=[1024, 1024]),
        },
    )
    b = detect_board(root)
    assert b.name == "generic" and b.isa == "x86_avx2"
    assert b.ram_bytes == 24 * GIB_KB * 1024
    assert b.os_reserve_bytes == 24 * GIB_KB * 1024 // 16


def test_missing_files_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(HostReadError, match="meminfo"):
        detect_board(tmp_path)
    _build(tmp_path, {"proc/meminfo": _meminfo(4_000_000)})
    with pytest.raises(HostReadError, match="online"):
        detect_board(tmp_path)


def test_this_host() -> None:
    cpu = read_cpu_facts(Path("/"))
    assert set(cpu.usable) <= os.sched_getaffinity(0)
    assert 1 <= cpu.usable_count <= len(os.sched_getaffinity(0))


def test_pure_helpers() -> None:
    assert parse_cpu_max_v2("max 100000") is None
    assert parse_cpu_max_v2("150000 100000") == 1.5
    assert parse_cfs_v1("-1", "100000") is None
    assert parse_cfs_v1("50000", "100000") == 0.5
    assert family_from_device_tree("Orange Pi 5 Plus", ("rockchip,rk3588",)) == "rk3588"
    assert family_from_device_tree("Some RK3588 board", ()) == "rk3588"
    assert family_from_device_tree("x", ("vendor,other",)) is None
    assert pick_variant("rpi5", 100 * GIB_KB * 1024).name == "rpi5-8g"


def test_profiles_and_unknown_name() -> None:
    rk = get_profile("rk3588-4g")
    assert rk.big_cores == (4, 5, 6, 7) and rk.boot_file == "/boot/armbianEnv.txt"
    assert {"rk3588-8g", "rk3588-16g", "jetson-orin-nano-8g", "rpi5-4g", "generic"} <= set(PROFILES)
    with pytest.raises(UsageError, match="unknown board"):
        get_profile("pdp-11")
