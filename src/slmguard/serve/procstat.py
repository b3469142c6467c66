"""Per-process memory from ``/proc/<pid>/status`` (RSS split by kind).

Owns the parse of VmRSS / RssAnon / RssFile / RssShmem (the split lines exist
since Linux 4.5) and a reader that takes a ``root`` so tests use a tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_FIELDS = {
    "VmRSS": "rss_bytes",
    "RssAnon": "rss_anon_bytes",
    "RssFile": "rss_file_bytes",
    "RssShmem": "rss_shmem_bytes",
}


@dataclass(frozen=True)
class ProcessMemory:
    rss_bytes: int | None = None
    rss_anon_bytes: int | None = None
    rss_file_bytes: int | None = None
    rss_shmem_bytes: int | None = None


def parse_status(text: str) -> ProcessMemory:
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if sep and key in _FIELDS:
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[_FIELDS[key]] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
    return ProcessMemory(**values)


def read_process_memory(pid: int | str, root: Path = Path("/")) -> ProcessMemory | None:
    """None when the process is gone or unreadable."""
    try:
        text = (root / "proc" / str(pid) / "status").read_text(encoding="utf-8")
    except OSError:
        return None
    return parse_status(text)
