"""The CPU cores: which are online and big, which this process may use, how busy, how fast.

Owns ``/sys/devices/system/cpu`` (``online``, ``cpu_capacity``, each core's cpufreq:
clock, limits, governor and the ones available, policy, x86 ``core_throttle_count``),
``/proc/stat`` (busy time per core) and this process's usable CPUs: its affinity
(``Cpus_allowed_list``, through :mod:`slmguard.host.process`) within its cgroup's cpuset
and quota (v2 ``cpu.max`` and ``cpuset.cpus.effective``, v1 CFS quota and
``cpuset.effective_cpus``). Never ``os.cpu_count()``: it ignores affinity and quotas.
Big cores rank by ``cpu_capacity`` (arm64 since Linux 4.15, 1024 for the fastest), else
by ``cpuinfo_max_freq``. Not the instruction set (:mod:`slmguard.host.cpufeatures`), nor
whether a cooling device slows a core (:mod:`slmguard.host.thermal`). Pure parsers plus
readers taking a root.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import files
from slmguard.host.cgroup import controller_dirs
from slmguard.host.files import ROOT
from slmguard.host.process import read_status
from slmguard.host.systemd import parse_cpu_set

CPU_DIR = "sys/devices/system/cpu"
THROTTLE_COUNT = "thermal_throttle/core_throttle_count"  # x86, under cpuN/
#: Bound on the cores parsed from a hostile file.
MAX_CPUS = 4096
MAX_GOVERNORS = 32


@dataclass(frozen=True)
class CpuFacts:
    """What the host says about its CPUs and what this process may use."""

    online: tuple[int, ...]
    capacity: Mapping[int, int] = field(default_factory=dict)  # cpu_capacity
    max_freq_khz: Mapping[int, int] = field(default_factory=dict)
    affinity: tuple[int, ...] = ()  # Cpus_allowed_list ∩ online
    cpuset: tuple[int, ...] | None = None  # the cgroup's effective cpuset
    quota_cpus: float | None = None  # cgroup quota / period; None = unlimited

    @property
    def big_cores(self) -> tuple[int, ...]:
        """The fastest cores by capacity, else by max frequency, else all online."""
        for rank in (self.capacity, self.max_freq_khz):
            known = {c: v for c, v in rank.items() if c in self.online}
            if known and len(known) == len(self.online):
                top = max(known.values())
                return tuple(sorted(c for c, v in known.items() if v == top))
        return self.online

    @property
    def usable(self) -> tuple[int, ...]:
        """Online CPUs inside both the affinity mask and the cgroup cpuset."""
        cpus = set(self.online)
        if self.affinity:
            cpus &= set(self.affinity)
        if self.cpuset is not None:
            cpus &= set(self.cpuset)
        return tuple(sorted(cpus))

    @property
    def usable_count(self) -> int:
        """How many threads can run at once: usable CPUs, capped by the quota."""
        n = len(self.usable)
        if self.quota_cpus is not None:
            n = min(n, max(1, math.floor(self.quota_cpus)))
        return max(n, 1)


def parse_cpu_max_v2(text: str) -> float | None:
    """``cpu.max`` (``"max 100000"`` or ``"200000 100000"``) as CPUs; None = unlimited."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = int(parts[1]) if len(parts) > 1 else 100_000
    return int(parts[0]) / period


def parse_cfs_v1(quota_text: str, period_text: str) -> float | None:
    """v1 ``cpu.cfs_quota_us`` (-1 = unlimited) / ``cpu.cfs_period_us``."""
    quota = int(quota_text.strip())
    if quota < 0:
        return None
    return quota / int(period_text.strip())


def _per_cpu_int(root: Path, online: tuple[int, ...], rel: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for cpu in online:
        text = files.read(root / CPU_DIR / f"cpu{cpu}" / rel).text
        if text is not None and text.strip().isdigit():
            out[cpu] = int(text.strip())
    return out


def _cgroup_cpu_limits(root: Path) -> tuple[tuple[int, ...] | None, float | None]:
    try:
        dirs = controller_dirs(root)
    except HostReadError:
        dirs = {}  # unreadable membership: no limits known, as without cgroups
    cpuset: tuple[int, ...] | None = None
    quota: float | None = None
    v2 = dirs.get("unified")
    if v2 is not None:
        text = files.read(v2 / "cpu.max").text
        if text is not None:
            quota = parse_cpu_max_v2(text)
        text = files.read(v2 / "cpuset.cpus.effective").text
        if text is not None and text.strip():
            cpuset = parse_cpu_set(text)
    v1cpu = dirs.get("cpu")
    if quota is None and v1cpu is not None:
        q = files.read(v1cpu / "cpu.cfs_quota_us").text
        p = files.read(v1cpu / "cpu.cfs_period_us").text
        if q is not None and p is not None:
            quota = parse_cfs_v1(q, p)
    v1set = dirs.get("cpuset")
    if cpuset is None and v1set is not None:
        for name in ("cpuset.effective_cpus", "cpuset.cpus"):
            text = files.read(v1set / name).text
            if text is not None and text.strip():
                cpuset = parse_cpu_set(text)
                break
    return cpuset, quota


def read_cpu_facts(root: Path = ROOT) -> CpuFacts:
    """Read the CPU topology and this process's usable CPUs under ``root``."""
    try:
        online = parse_cpu_set(files.read(root / CPU_DIR / "online").require())
    except ValueError as err:
        raise HostReadError(root / CPU_DIR / "online", f"unparsable: {err}") from err
    if not online:
        raise HostReadError(root / CPU_DIR / "online", "no online CPUs listed")
    status = read_status(root)
    allowed = status.cpus_allowed if status is not None else ()
    affinity = tuple(c for c in allowed if c in online)
    cpuset, quota = _cgroup_cpu_limits(root)
    return CpuFacts(
        online=online,
        capacity=_per_cpu_int(root, online, "cpu_capacity"),
        max_freq_khz=_per_cpu_int(root, online, "cpufreq/cpuinfo_max_freq"),
        affinity=affinity,
        cpuset=cpuset,
        quota_cpus=quota,
    )


def usable_threads(root: Path = ROOT) -> int:
    """How many engine threads can run at once here (:attr:`CpuFacts.usable_count`).

    The affinity mask and the cgroup's cpuset, capped by its quota (v2
    ``cpu.max``, v1 CFS quota). Where ``/sys`` does not list the online CPUs
    (a minimal container), the affinity mask alone: never ``os.cpu_count()``.
    """
    try:
        return read_cpu_facts(root).usable_count
    except HostReadError:
        return max(1, len(os.sched_getaffinity(0)))


# ---------------------------------------------------------------- busy time: /proc/stat


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative ticks of one core (``cpu`` None: the all-cores line)."""

    cpu: int | None
    busy_ticks: int
    total_ticks: int


def parse_proc_stat(text: str) -> dict[int | None, CpuTimes]:
    """The ``cpu``/``cpuN`` lines of /proc/stat (proc(5)), keyed by core (None: all cores).

    Ten columns of USER_HZ ticks: ``user nice system idle iowait irq softirq steal guest
    guest_nice``. ``guest`` and ``guest_nice`` are already in ``user`` and ``nice``
    (kernel/sched/cputime.c), so they are not added again; kernels before 2.6.33 print
    fewer columns, which count as 0. Busy = total - idle - iowait.
    """
    out: dict[int | None, CpuTimes] = {}
    for line in text.splitlines():
        if not line.startswith("cpu"):
            continue
        parts = line.split()
        name = parts[0][3:]
        if name and not name.isdigit():
            continue
        cpu = int(name) if name else None
        if cpu is not None and cpu >= MAX_CPUS:
            continue
        try:
            cols = [int(x) for x in parts[1:11]]
        except ValueError:
            continue
        cols += [0] * (10 - len(cols))
        user, nice, system, idle, iowait, irq, softirq, steal = cols[:8]
        total = user + nice + system + idle + iowait + irq + softirq + steal
        out[cpu] = CpuTimes(cpu, total - idle - iowait, total)
    return out


def busy_pct(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """Percent of the interval the core was busy; None without two usable reads (a core
    that went offline and came back may show counters lower than before)."""
    if before is None or after is None:
        return None
    total = after.total_ticks - before.total_ticks
    busy = after.busy_ticks - before.busy_ticks
    if total <= 0 or busy < 0:
        return None
    return min(100.0, 100.0 * busy / total)


def read_proc_stat(root: Path = ROOT) -> dict[int | None, CpuTimes]:
    """Raises HostReadError when /proc/stat cannot be read."""
    return parse_proc_stat(files.read(root / "proc/stat").require())


# ---------------------------------------------------------------- clocks: cpufreq


@dataclass(frozen=True)
class CpuFreq:
    """One core's frequency facts in kHz. ``None`` where the kernel did not say."""

    cpu: int
    cur_khz: int | None
    scaling_max_khz: int | None
    hw_max_khz: int | None  # cpuinfo_max_freq
    governor: str | None = None
    policy_cpus: tuple[int, ...] = ()  # related_cpus: the cores that share this clock
    throttle_count: int | None = None  # x86 thermal_throttle/core_throttle_count
    error: str | None = None
    scaling_min_khz: int | None = None
    available_governors: tuple[str, ...] = ()  # scaling_available_governors

    @property
    def capped(self) -> bool:
        """scaling_max_freq below the hardware maximum (a policy or a user limit)."""
        return (
            self.scaling_max_khz is not None
            and self.hw_max_khz is not None
            and self.scaling_max_khz < self.hw_max_khz
        )


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``related_cpus`` (``"0 1 2 3"`` or ``"4-5"``); empty when garbled or out of bounds."""
    numbers = [int(n) for n in re.findall(r"\d+", text)]
    if not numbers or max(numbers) >= MAX_CPUS:
        return ()
    try:
        return parse_cpu_set(text)
    except ValueError:
        return ()


def read_cpufreq(root: Path, cpus: Iterable[int]) -> tuple[CpuFreq, ...]:
    """cpufreq facts of ``cpus`` (``cpuN/cpufreq``, a link to its ``policyK``); a core
    without cpufreq (a VM) has Nones and no error."""
    out = []
    for cpu in cpus:
        base = root / CPU_DIR / f"cpu{cpu}"
        freq = base / "cpufreq"
        cur = files.read_attr(freq / "scaling_cur_freq")
        policy = parse_cpu_list(files.read_attr(freq / "related_cpus").text or "")
        governor = files.read_attr(freq / "scaling_governor").text
        out.append(
            CpuFreq(
                cpu=cpu,
                cur_khz=cur.integer(),
                scaling_max_khz=files.read_attr(freq / "scaling_max_freq").integer(),
                hw_max_khz=files.read_attr(freq / "cpuinfo_max_freq").integer(),
                governor=governor.strip() if governor else None,
                policy_cpus=policy,
                throttle_count=files.read_attr(base / THROTTLE_COUNT).integer(),
                error=cur.error,
                scaling_min_khz=files.read_attr(freq / "scaling_min_freq").integer(),
                available_governors=tuple(
                    w[:64]
                    for w in (
                        files.read_attr(freq / "scaling_available_governors").text or ""
                    ).split()[:MAX_GOVERNORS]
                ),
            )
        )
    return tuple(out)
