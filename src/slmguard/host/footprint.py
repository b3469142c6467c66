"""A process's footprint over weeks: its private memory, swapped or not, and its writes.

Owns two small reads of ``/proc/<pid>`` that the leak tracker and the write
accounting need and :mod:`slmguard.host.process` does not give:

- ``status``: ``RssAnon`` + ``RssShmem`` + ``VmSwap``, the memory no file backs,
  resident or swapped out. A process that leaks while the kernel swaps it out shows
  a flat RssAnon and a growing VmSwap (ollama #18106): only the sum is the leak.
  (``RssAnon``/``RssShmem`` since Linux 4.5, ``VmSwap`` since 2.6.34; a missing line
  counts 0, a status without ``RssAnon`` is a kernel thread or a very old kernel: None.)
- ``io``: ``write_bytes``, what the process caused to be written to storage (page
  cache flushes it later; ``cancelled_write_bytes`` is what truncation took back),
  and ``wchar``, what it passed to write(2) at all (task_io_accounting, needs
  ``CONFIG_TASK_IO_ACCOUNTING``; readable for one's own processes or as root).

Pure parsers plus readers that take a root path; a process that is gone reads None.
It changes nothing and reads no other file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slmguard.host import files
from slmguard.host.files import ROOT

_KIB = 1024
_STATUS_KEYS = {"RssAnon": "anon", "RssShmem": "shmem", "VmSwap": "swap"}


@dataclass(frozen=True)
class MemoryFootprint:
    """What one process holds that no file backs, in bytes."""

    anon_bytes: int
    shmem_bytes: int
    swap_bytes: int

    @property
    def private_bytes(self) -> int:
        """RssAnon + RssShmem + VmSwap: resident or swapped out, the same leak."""
        return self.anon_bytes + self.shmem_bytes + self.swap_bytes


@dataclass(frozen=True)
class IoCounters:
    """``/proc/<pid>/io``: bytes written to storage, bytes passed to write(2)."""

    write_bytes: int
    cancelled_write_bytes: int
    wchar: int

    @property
    def stored_bytes(self) -> int:
        """What reached (or will reach) storage: write_bytes less what truncation cancelled."""
        return max(0, self.write_bytes - self.cancelled_write_bytes)


def parse_footprint(status_text: str) -> MemoryFootprint | None:
    """``RssAnon``/``RssShmem``/``VmSwap`` of ``/proc/<pid>/status`` text; None without
    ``RssAnon`` (a kernel thread, or a kernel before 4.5)."""
    values: dict[str, int] = {}
    for line in status_text.splitlines():
        key, sep, rest = line.partition(":")
        name = _STATUS_KEYS.get(key) if sep else None
        if name is None:
            continue
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name] = int(parts[0]) * (_KIB if parts[-1] == "kB" else 1)
    if "anon" not in values:
        return None
    return MemoryFootprint(values["anon"], values.get("shmem", 0), values.get("swap", 0))


def parse_io(io_text: str) -> IoCounters | None:
    """``/proc/<pid>/io`` text (``key: value`` lines); None without ``write_bytes``."""
    values: dict[str, int] = {}
    for line in io_text.splitlines():
        key, sep, rest = line.partition(":")
        value = rest.strip()
        if sep and value.isdigit():
            values[key.strip()] = int(value)
    if "write_bytes" not in values:
        return None
    return IoCounters(
        values["write_bytes"], values.get("cancelled_write_bytes", 0), values.get("wchar", 0)
    )


def _read(root: Path, pid: int | str, name: str) -> str | None:
    return files.read(root / "proc" / str(pid) / name).text  # None: gone, or not ours to read


def read_footprint(root: Path = ROOT, pid: int | str = "self") -> MemoryFootprint | None:
    """``pid``'s footprint; None when it is gone or its status says none."""
    text = _read(root, pid, "status")
    return None if text is None else parse_footprint(text)


def read_io(root: Path = ROOT, pid: int | str = "self") -> IoCounters | None:
    """``pid``'s write counters; None when it is gone, unreadable or without accounting."""
    text = _read(root, pid, "io")
    return None if text is None else parse_io(text)
