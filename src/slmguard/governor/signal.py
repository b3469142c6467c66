"""The governor's memory signal: how full the service's memory really is.

Owns turning host files into one :class:`MemorySnapshot` per sample, and the
governor's use of the adaptive sampling interval. It reads only (through
``slmguard.host``) and decides nothing: levels and actions are
``governor.policy``. The limit, how-full and interval arithmetic is
:mod:`slmguard.host.headroom`, shared with the watcher.

Three signals, strongest first:

1. **Working set against the effective limit.** The working set is the
   kubelet's: cgroup usage minus inactive file pages, so the page cache of the
   mapped GGUF (reclaimed before the cgroup hits its limit) is not mistaken for
   pressure. The effective limit is the smallest of: the cgroup's memory.high
   (or memory.max; on v1 memory.limit_in_bytes and the
   ``hierarchical_memory_limit`` an ancestor imposes), the configured budget,
   the plan's ``limits.memory_high_bytes``, and working set + MemAvailable (a
   cgroup limit above what the host can still hand out is not a real limit;
   without any cgroup limit this is the bound that remains).
2. **PSI** ``some avg10`` of the cgroup's memory.pressure (v2) or of
   /proc/pressure/memory: time lost stalling on memory.
3. **Commit headroom** CommitLimit - Committed_AS, meaningful only under
   ``vm.overcommit_memory=2`` (the mode the source document sets): there an
   allocation fails outright once Committed_AS reaches CommitLimit, whatever
   the working set says.

Without a memory controller at all the working set is the sum of anonymous and
shmem RSS of the service's processes (``/proc/<pid>/status``).
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
from slmguard.host.process import read_status
from slmguard.host.procfs import read_meminfo, read_text
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


@dataclass(frozen=True)
class MemorySnapshot:
    """One sample of the memory signal. ``None`` where the host did not say.

    ``used_pct`` = working_set_bytes / limit_bytes * 100. ``commit_used_pct`` =
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

    @property
    def used_pct(self) -> float | None:
        return headroom.used_pct(self.working_set_bytes, self.limit_bytes)

    @property
    def headroom_bytes(self) -> int | None:
        return headroom.headroom_bytes(self.working_set_bytes, self.limit_bytes)

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
        snapshot.working_set_bytes,
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
    processes, used only when there is no memory controller.

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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.cgroup_dir = cgroup_dir if cgroup_dir is not None else cg.memory_cgroup_dir(root)
        self.budget_bytes = budget_bytes
        self.plan_limit_bytes = plan_limit_bytes
        self._pids = pids or (lambda: [os.getpid()])
        self._clock = clock
        self._psi_path = self._find_psi()

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

    def _overcommit_mode(self) -> int | None:
        try:
            return int(read_text(self.root, OVERCOMMIT_PATH).strip())
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
        candidates += [
            (self.budget_bytes, "budget"),
            (self.plan_limit_bytes, "plan"),
            (None if available is None else working_set + available, "mem_available"),
        ]
        limit, limit_source = headroom.effective_limit(candidates)
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
        )
