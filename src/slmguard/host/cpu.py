"""CPU topology and the CPUs this process may actually use.

Owns reading ``/sys/devices/system/cpu`` (online CPUs, ``cpu_capacity``,
cpufreq maximum frequency), this process's affinity (``Cpus_allowed_list``
of ``/proc/self/status`` through :mod:`slmguard.host.process`, the same set
``sched_getaffinity`` returns) and its cgroup's CPU limits (v2 ``cpu.max`` and
``cpuset.cpus.effective``; v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` and
``cpuset.effective_cpus``). Never ``os.cpu_count()``: it ignores affinity and
quotas, so a container limited to 2 CPUs on a 64-core host would start 64
threads.

Big cores: on heterogeneous SoCs (RK3588: 4x Cortex-A55 + 4x Cortex-A76) the
kernel exports ``cpu_capacity`` (arm64 since Linux 4.15, normalised to 1024
for the fastest core); without it, the cpufreq ``cpuinfo_max_freq`` ranks
cores. The big cores are those with the highest value; a homogeneous CPU has
all cores "big".

Everything takes a ``root`` so tests point it at a fixture tree.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host.cgroup import controller_dirs
from slmguard.host.process import read_status
from slmguard.host.procfs import ROOT, read_text
from slmguard.host.systemd import parse_cpu_set

_CPU_DIR = "sys/devices/system/cpu"


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


def _maybe(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _per_cpu_int(root: Path, online: tuple[int, ...], rel: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for cpu in online:
        text = _maybe(root / _CPU_DIR / f"cpu{cpu}" / rel)
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
        text = _maybe(v2 / "cpu.max")
        if text is not None:
            quota = parse_cpu_max_v2(text)
        text = _maybe(v2 / "cpuset.cpus.effective")
        if text is not None and text.strip():
            cpuset = parse_cpu_set(text)
    v1cpu = dirs.get("cpu")
    if quota is None and v1cpu is not None:
        q, p = _maybe(v1cpu / "cpu.cfs_quota_us"), _maybe(v1cpu / "cpu.cfs_period_us")
        if q is not None and p is not None:
            quota = parse_cfs_v1(q, p)
    v1set = dirs.get("cpuset")
    if cpuset is None and v1set is not None:
        for name in ("cpuset.effective_cpus", "cpuset.cpus"):
            text = _maybe(v1set / name)
            if text is not None and text.strip():
                cpuset = parse_cpu_set(text)
                break
    return cpuset, quota


def read_cpu_facts(root: Path = ROOT) -> CpuFacts:
    """Read the CPU topology and this process's usable CPUs under ``root``."""
    try:
        online = parse_cpu_set(read_text(root, f"{_CPU_DIR}/online"))
    except ValueError as err:
        raise HostReadError(root / _CPU_DIR / "online", f"unparsable: {err}") from err
    if not online:
        raise HostReadError(root / _CPU_DIR / "online", "no online CPUs listed")
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
