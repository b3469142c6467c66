"""The governor's memory signal: how full the service's memory really is.

Owns turning host files into one :class:`MemorySnapshot` per sample, and the governor's
use of the adaptive sampling interval. Three signals, strongest first: the working set
(the kubelet's: usage - inactive_file, so the mapped GGUF's page cache is not pressure)
against the effective limit (the smallest of memory.high/max or v1's limits, the
budget, the plan's MemoryHigh, and working set + MemAvailable); PSI ``some avg10``; and
commit headroom (CommitLimit - Committed_AS, which matters under
``vm.overcommit_memory=2``). Where this process's cgroup is not visible or does not
count it alone (:func:`slmguard.host.cgroup.counts_own_memory`) the working set is the
service's processes' anon + shmem RSS; with ``limits.device_bytes`` set, the engine's
device memory outside the cgroup (:mod:`slmguard.host.devmem`) is added to the working
set and to each cgroup-only limit. ``docs/governor.md`` (The signal) tells each case.

It reads only, through ``slmguard.host``, and decides nothing: levels and actions are
:mod:`slmguard.governor.policy`; the limit, how-full and interval arithmetic is
:mod:`slmguard.host.headroom`, shared with the watcher.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import cgroup as cg
from slmguard.host import headroom
from slmguard.host.devmem import read_device_memory
from slmguard.host.files import read
from slmguard.host.process import read_status
from slmguard.host.procfs import MemInfo, read_meminfo
from slmguard.host.psi import PROC_PRESSURE_MEMORY, read_pressure

log = logging.getLogger(__name__)

ROOT = Path("/")
OVERCOMMIT_PATH = "proc/sys/vm/overcommit_memory"

# earlyoom assumes RAM fills at up to 6000 MiB/s on a desktop; page-faulting
# allocations on the boards we target (LPDDR4/5, Cortex-A76 / A78AE) run far
# slower. 2 GiB/s is a deliberately pessimistic figure for them.
DEFAULT_FILL_RATE_BYTES_PER_S = 2 << 30
DEFAULT_MIN_INTERVAL_S = 0.02
DEFAULT_MAX_INTERVAL_S = 1.0
#: What the governor counts without a memory cgroup of the service's own.
PROCESSES_FALLBACK = (
    "the governor counts the server's and the engine's own memory (anonymous + shmem "
    "RSS) against the plan's limit, the budget and MemAvailable instead"
)


@dataclass(frozen=True)
class MemorySnapshot:
    """One sample of the memory signal. ``None`` where the host did not say.

    ``used_bytes`` = working_set_bytes + device_bytes (the engine's device memory
    outside its cgroup, 0 unless the plan gives it an allowance); ``used_pct`` =
    used_bytes / limit_bytes * 100. ``commit_used_pct`` =
    Committed_AS / CommitLimit * 100, set only when overcommit mode is 2.
    ``taken_s`` is a monotonic clock reading, not wall time.
    """

    taken_s: float
    source: str  # "cgroup2" | "cgroup1" | "processes"
    working_set_bytes: int
    limit_bytes: int | None
    limit_source: str | None  # which candidate set the limit (see module docstring)
    usage_bytes: int | None = None
    cgroup_path: str | None = None
    mem_available_bytes: int | None = None
    psi_some_avg10_pct: float | None = None
    psi_full_avg10_pct: float | None = None
    overcommit_mode: int | None = None
    commit_limit_bytes: int | None = None
    committed_as_bytes: int | None = None
    oom_kill_count: int | None = None
    device_bytes: int = 0  # the engine's device memory its cgroup does not count
    device_source: str | None = None  # "devmem" | "NvMapMemUsed" | None: not counted

    @property
    def used_bytes(self) -> int:
        return self.working_set_bytes + self.device_bytes

    @property
    def used_pct(self) -> float | None:
        return headroom.used_pct(self.used_bytes, self.limit_bytes)

    @property
    def headroom_bytes(self) -> int | None:
        return headroom.headroom_bytes(self.used_bytes, self.limit_bytes)

    @property
    def commit_used_pct(self) -> float | None:
        if self.overcommit_mode != 2 or not self.commit_limit_bytes:
            return None
        if self.committed_as_bytes is None:
            return None
        return 100.0 * self.committed_as_bytes / self.commit_limit_bytes

    def as_dict(self) -> dict[str, object]:
        """JSON-ready view (for ``GET /api/v1/governor`` and log lines)."""
        return {
            "source": self.source,
            "cgroup_path": self.cgroup_path,
            "usage_bytes": self.usage_bytes,
            "working_set_bytes": self.working_set_bytes,
            "device_bytes": self.device_bytes,
            "device_source": self.device_source,
            "used_bytes": self.used_bytes,
            "limit_bytes": self.limit_bytes,
            "limit_source": self.limit_source,
            "used_pct": _round(self.used_pct),
            "mem_available_bytes": self.mem_available_bytes,
            "psi_some_avg10_pct": self.psi_some_avg10_pct,
            "psi_full_avg10_pct": self.psi_full_avg10_pct,
            "overcommit_mode": self.overcommit_mode,
            "commit_limit_bytes": self.commit_limit_bytes,
            "committed_as_bytes": self.committed_as_bytes,
            "commit_used_pct": _round(self.commit_used_pct),
            "oom_kill_count": self.oom_kill_count,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


# ---------------------------------------------------------------- pure parts


def sample_interval_s(
    snapshot: MemorySnapshot,
    watermarks_pct: Iterable[float],
    *,
    fill_rate_bytes_per_s: float = DEFAULT_FILL_RATE_BYTES_PER_S,
    min_s: float = DEFAULT_MIN_INTERVAL_S,
    max_s: float = DEFAULT_MAX_INTERVAL_S,
) -> float:
    """How long to sleep before the next sample: :func:`slmguard.host.headroom.poll_interval_s`.

    The time memory would need, filling at the worst-case rate, to cross the
    next watermark above the current level (one look per crossing), clamped to
    [min_s, max_s]. The watcher uses the same formula with its own rate and lines.
    """
    return headroom.poll_interval_s(
        snapshot.used_bytes,
        snapshot.limit_bytes,
        fill_rate_bytes_per_s=fill_rate_bytes_per_s,
        min_s=min_s,
        max_s=max_s,
        lines_pct=watermarks_pct,
    )


# ---------------------------------------------------------------- the reader


class MemorySignal:
    """Samples the memory signal of one service.

    ``root`` is the host root (tests point it at a fixture tree). ``cgroup_dir``
    defaults to the memory cgroup of this process, found once at construction.
    ``budget_bytes`` is the configured budget, ``plan_limit_bytes`` the plan's
    ``limits.memory_high_bytes``; both optional. ``pids`` lists the service's
    processes, used only when there is no memory controller or this process's memory
    cgroup does not count it alone (then ``cgroup_dir`` is None). ``device_bytes`` is the
    plan's ``limits.device_bytes`` (0: device memory is not counted) and
    ``device_pid`` the engine's pid (None while it is not running).

    Example::

        signal = MemorySignal(budget_bytes=2600 << 20)
        snap = signal.sample()
        snap.working_set_bytes, snap.limit_bytes, snap.used_pct
    """

    def __init__(
        self,
        root: Path = ROOT,
        *,
        cgroup_dir: Path | None = None,
        budget_bytes: int | None = None,
        plan_limit_bytes: int | None = None,
        pids: Callable[[], Iterable[int]] | None = None,
        device_bytes: int = 0,
        device_pid: Callable[[], int | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.cgroup_dir = cgroup_dir if cgroup_dir is not None else self._own_cgroup(root)
        self.budget_bytes = budget_bytes
        self.plan_limit_bytes = plan_limit_bytes
        self._pids = pids or (lambda: [os.getpid()])
        self.device_bytes = device_bytes
        self._device_pid = device_pid or (lambda: None)
        self._device_problems: tuple[str, ...] = ()
        self._clock = clock
        self._psi_path = self._find_psi()

    @staticmethod
    def _own_cgroup(root: Path) -> Path | None:
        """This process's memory cgroup; None (said once, with the fallback) when there is
        none, it is not visible here, or it is the whole host."""
        found = cg.memory_cgroup_dir(root)
        if found is None:
            log.info("no memory cgroup is visible to this process: %s", PROCESSES_FALLBACK)
        elif not found.is_dir():
            # /proc names a cgroup whose directory is not there: a chroot (the host's /proc
            # without its /sys/fs/cgroup) or a container without its cgroup mounted.
            log.warning(
                "memory cgroup %s is not visible here (a chroot, or a container without "
                "its cgroup mounted): %s",
                found,
                PROCESSES_FALLBACK,
            )
            return None
        elif not cg.counts_own_memory(found):
            log.warning(
                "memory cgroup %s does not count this service alone (the hierarchy's root: "
                "the whole host): %s; run it in a unit or container of its own to count "
                "its cgroup",
                found,
                PROCESSES_FALLBACK,
            )
            return None
        return found

    def _find_psi(self) -> Path | None:
        if self.cgroup_dir is not None and (self.cgroup_dir / cg.V2_PRESSURE).exists():
            return self.cgroup_dir / cg.V2_PRESSURE
        proc = self.root / PROC_PRESSURE_MEMORY
        return proc if proc.exists() else None

    def _processes_working_set(self) -> int:
        total = 0
        for pid in self._pids():
            status = read_status(self.root, pid)
            if status is not None:  # None: it exited between listing and reading
                total += status.private_bytes
        return total

    def _device_used(self, meminfo: MemInfo) -> tuple[int, str | None]:
        """The engine's device memory outside its cgroup, and where it was read."""
        pid = self._device_pid() if self.device_bytes > 0 else None
        mem = None if pid is None else read_device_memory(self.root, pid, meminfo=meminfo)
        if mem is None:
            return 0, None
        if mem.problems != self._device_problems:  # said once per change, not per sample
            self._device_problems = mem.problems
            for problem in mem.problems:
                log.warning("device memory: %s", problem)
        if mem.nvmap_bytes is None and mem.nvmap_system_bytes is not None:
            # debugfs unreadable: every nvmap client's pages, the engine's among them
            return mem.outside_cgroup_bytes + mem.nvmap_system_bytes, "NvMapMemUsed"
        return mem.outside_cgroup_bytes, "devmem"

    def _overcommit_mode(self) -> int | None:
        try:
            return int(read(self.root / OVERCOMMIT_PATH).require().strip())
        except (HostReadError, ValueError):
            return None

    def sample(self) -> MemorySnapshot:
        """Read the signal once. Raises HostReadError when the cgroup files are unreadable."""
        taken = self._clock()
        candidates: list[tuple[int | None, str]] = []
        usage: int | None = None
        oom_kills: int | None = None
        if self.cgroup_dir is not None:
            mem = cg.read_memory(self.cgroup_dir)
            source = f"cgroup{mem.version}"
            usage = mem.usage_bytes
            working_set = mem.working_set_bytes or 0
            oom_kills = mem.oom_kill_count
            # v2 memory.high and memory.max; v1 limit_in_bytes and an ancestor's
            # smaller limit (hierarchical_memory_limit).
            candidates += mem.limit_candidates
        else:
            source = "processes"
            working_set = self._processes_working_set()
        meminfo = read_meminfo(self.root)
        available = meminfo.mem_available_bytes
        device, device_source = self._device_used(meminfo)
        candidates += [(self.budget_bytes, "budget"), (self.plan_limit_bytes, "plan")]
        limit, limit_source = headroom.effective_limit(candidates)
        if limit is not None and device_source is not None:
            limit += self.device_bytes  # those bound the cgroup; the device has its allowance
        limit, limit_source = headroom.effective_limit([
            (limit, limit_source or ""),
            (None if available is None else working_set + device + available, "mem_available"),
        ])  # fmt: skip
        psi_some = psi_full = None
        if self._psi_path is not None:
            try:
                pressure = read_pressure(self._psi_path)
                psi_some, psi_full = pressure.some_avg10_pct, pressure.full_avg10_pct
            except HostReadError as err:  # psi=0 on the kernel command line
                log.debug("PSI unavailable: %s", err)
                self._psi_path = None
        return MemorySnapshot(
            taken_s=taken,
            source=source,
            working_set_bytes=working_set,
            limit_bytes=limit,
            limit_source=limit_source,
            usage_bytes=usage,
            cgroup_path=None if self.cgroup_dir is None else str(self.cgroup_dir),
            mem_available_bytes=available,
            psi_some_avg10_pct=psi_some,
            psi_full_avg10_pct=psi_full,
            overcommit_mode=self._overcommit_mode(),
            commit_limit_bytes=meminfo.commit_limit_bytes,
            committed_as_bytes=meminfo.committed_as_bytes,
            oom_kill_count=oom_kills,
            device_bytes=device,
            device_source=device_source,
        )
