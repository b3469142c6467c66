"""Where a process's threads are: state, kernel wait channel and stack, from ``/proc``.

Owns the evidence of a stuck process: per thread ``/proc/PID/task/TID/stat``
(state letter: R running, S sleeping, D uninterruptible, T stopped, t traced,
Z zombie), ``comm`` and ``wchan`` (the kernel function a sleeping thread waits
in; ``0`` when running), and the kernel stack ``/proc/PID/stack`` (root only,
and only on kernels built with ``CONFIG_STACKTRACE``). A pure parser plus
readers taking a root; what cannot be read is ``None``, never an error: this
runs when something is already wrong.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ThreadState:
    tid: int
    name: str
    state: str  # one letter, as in /proc/PID/stat
    wchan: str | None  # None: unreadable (ptrace access mode)


def parse_stat_state(text: str) -> tuple[str, str] | None:
    """(comm, state) from a ``stat`` line; ``comm`` may hold spaces and parentheses."""
    start, end = text.find("("), text.rfind(")")
    if start < 0 or end < start:
        return None
    rest = text[end + 1 :].split()
    if not rest:
        return None
    return text[start + 1 : end], rest[0]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def read_thread_states(
    pid: int, root: Path = Path("/"), limit: int = 256
) -> tuple[ThreadState, ...]:
    """Every thread of ``pid`` (at most ``limit``), in tid order; empty when it is gone."""
    task = root / "proc" / str(pid) / "task"
    try:
        tids = sorted(int(p.name) for p in task.iterdir() if p.name.isdigit())
    except OSError:
        return ()
    out = []
    for tid in tids[:limit]:
        stat = _read(task / str(tid) / "stat")
        parsed = parse_stat_state(stat) if stat is not None else None
        if parsed is None:
            continue
        wchan = _read(task / str(tid) / "wchan")
        out.append(ThreadState(tid, parsed[0], parsed[1], wchan.strip() if wchan else None))
    return tuple(out)


def read_kernel_stack(pid: int, root: Path = Path("/")) -> str | None:
    """``/proc/PID/stack`` (needs root); None when it cannot be read."""
    with contextlib.suppress(OSError):
        return (root / "proc" / str(pid) / "stack").read_text(errors="replace")
    return None
