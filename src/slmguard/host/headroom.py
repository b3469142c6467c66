"""How full memory is, and how soon to look again: arithmetic shared by governor and watch.

Owns three rules the memory governor (``governor.signal``) and the watchdog (``watch``)
must agree on, so that one board gives one answer: the **effective limit** (the smallest
of the candidates that are set: memory.high, memory.max, v1's limit and the
``hierarchical_memory_limit`` an ancestor imposes, a configured budget; with the name of
the one that won), **how full** (working set / limit, and the headroom) and the
**adaptive poll interval** (earlyoom's ``sleep_time_ms``: a sampler idles far from
trouble and tightens as headroom shrinks, so a crossing is seen at most one interval
late, and that interval is short exactly when a crossing is near). Pure: no I/O, no
clock; callers bring the numbers from :mod:`slmguard.host.cgroup` and ``host.procfs``.
"""

from __future__ import annotations

from collections.abc import Iterable


def effective_limit(
    candidates: Iterable[tuple[int | None, str]],
) -> tuple[int | None, str | None]:
    """The smallest candidate that is set, with its name; (None, None) when none is.

    Example::

        effective_limit([(None, "memory.high"), (2800 << 20, "memory.max")])
        # (2936012800, "memory.max")
    """
    best: tuple[int | None, str | None] = (None, None)
    for value, name in candidates:
        if value is not None and value > 0 and (best[0] is None or value < best[0]):
            best = (value, name)
    return best


def used_pct(working_set_bytes: int | None, limit_bytes: int | None) -> float | None:
    """working_set / limit * 100; None without a working set or a limit."""
    if working_set_bytes is None or not limit_bytes:
        return None
    return 100.0 * working_set_bytes / limit_bytes


def headroom_bytes(working_set_bytes: int, limit_bytes: int | None) -> int | None:
    """limit - working set (negative when over the limit); None without a limit."""
    return None if limit_bytes is None else limit_bytes - working_set_bytes


def poll_interval_s(
    working_set_bytes: int,
    limit_bytes: int | None,
    *,
    fill_rate_bytes_per_s: float,
    min_s: float,
    max_s: float,
    lines_pct: Iterable[float] = (),
    looks_per_crossing: float = 1.0,
) -> float:
    """Seconds until the next sample.

    The next line is the lowest of ``lines_pct`` (percentages of the limit)
    above the working set, else the limit itself. The interval is the time to
    reach it at ``fill_rate_bytes_per_s``, divided by ``looks_per_crossing``,
    clamped to [min_s, max_s]. No limit, or memory not filling (rate <= 0):
    ``max_s``; at or over the line: ``min_s``.

    Example (the governor: 150 MiB below its 85% line, a 1 GiB/s worst case)::

        poll_interval_s(700 << 20, 1000 << 20, fill_rate_bytes_per_s=1 << 30,
                        min_s=0.02, max_s=1.0, lines_pct=(85.0, 92.0, 97.0))
        # 0.146...
    """
    if not limit_bytes or fill_rate_bytes_per_s <= 0:
        return max_s
    above = sorted(limit_bytes * pct / 100.0 for pct in lines_pct)
    target = next((t for t in above if t > working_set_bytes), float(limit_bytes))
    headroom = target - working_set_bytes
    if headroom <= 0:
        return min_s
    interval = headroom / fill_rate_bytes_per_s / looks_per_crossing
    return min(max_s, max(min_s, interval))
