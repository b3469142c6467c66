"""What the benchmarks of slmguard's own footprint share (``top_footprint.py``,
``watch_footprint.py``): a process's memory and CPU time from ``/proc``, and its
steady-state window (a warm-up, then RSS sampled every second, the CPU time and the
work counted over the window alone)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def status_bytes(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of ``pid`` (``/proc/PID/status``), bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def cpu_ticks(pid: int) -> int:
    """utime + stime of ``pid`` (``/proc/PID/stat``, fields 14 and 15), clock ticks."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rfind(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


@dataclass(frozen=True)
class Window:
    """What one steady-state window saw: the warm-up's wall time and CPU ticks; the
    window's length, CPU ticks, RSS every second; the status at its end; and each
    counter's rise over the window."""

    startup_wall_s: float
    startup_ticks: int
    elapsed_s: float
    ticks: int
    rss: list[int]
    final: dict[str, int]
    counted: dict[str, int]


def steady_window(
    proc: subprocess.Popen[bytes],
    warmup_s: float,
    duration_s: float,
    counters: dict[str, Callable[[], int]],
    exited: Callable[[], str],
) -> Window:
    """Wait ``warmup_s``, then sample ``proc`` for ``duration_s``; RuntimeError with
    ``exited()`` if it ends before the window does."""
    pid = proc.pid
    start = time.monotonic()
    time.sleep(warmup_s)
    if proc.poll() is not None:
        raise RuntimeError(exited())
    warm_ticks = cpu_ticks(pid)
    warm = {name: count() for name, count in counters.items()}
    t0 = time.monotonic()
    rss: list[int] = []
    while time.monotonic() - t0 < duration_s:
        if proc.poll() is not None:
            raise RuntimeError(exited())
        rss.append(status_bytes(pid)["VmRSS"])
        time.sleep(1.0)
    elapsed = time.monotonic() - t0
    ticks = cpu_ticks(pid) - warm_ticks
    counted = {name: count() - warm[name] for name, count in counters.items()}
    return Window(t0 - start, warm_ticks, elapsed, ticks, rss, status_bytes(pid), counted)
