"""CPU time per core from ``/proc/stat``, and how busy each core was between two reads.

Owns parsing the ``cpu`` / ``cpuN`` lines of ``/proc/stat`` (proc(5)): ten
columns of USER_HZ ticks since boot, ``user nice system idle iowait irq
softirq steal guest guest_nice``. ``guest`` and ``guest_nice`` are already
counted in ``user`` and ``nice`` (kernel/sched/cputime.c), so they are not
added again; kernels before 2.6.33 print fewer columns, which count as 0.
Busy = total - idle - iowait. A core that went offline and came back may
show counters lower than before: that interval is reported as unknown.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slmguard.host.procfs import ROOT, read_text

#: Bound on the cores parsed from a hostile file.
MAX_CPUS = 4096


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative ticks of one core (``cpu`` None: the all-cores line)."""

    cpu: int | None
    busy_ticks: int
    total_ticks: int


def parse_proc_stat(text: str) -> dict[int | None, CpuTimes]:
    """The cpu lines of /proc/stat, keyed by core number (None for the ``cpu`` line)."""
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
    """Percent of the interval the core was busy; None without two usable reads."""
    if before is None or after is None:
        return None
    total = after.total_ticks - before.total_ticks
    busy = after.busy_ticks - before.busy_ticks
    if total <= 0 or busy < 0:
        return None
    return min(100.0, 100.0 * busy / total)


def read_proc_stat(root: Path = ROOT) -> dict[int | None, CpuTimes]:
    """Raises HostReadError when /proc/stat cannot be read."""
    return parse_proc_stat(read_text(root, "proc/stat"))
