"""Readers for ``/proc`` files that are not per-cgroup: meminfo and friends.

``parse_meminfo`` covers the fields slmguard uses; keys the kernel did not
print stay ``None`` (CmaTotal/CmaFree exist only with CONFIG_CMA; MemAvailable
since Linux 3.14).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError

ROOT = Path("/")


@dataclass(frozen=True)
class MemInfo:
    """Selected /proc/meminfo values in bytes (the file says kB, meaning KiB)."""

    mem_total_bytes: int
    mem_free_bytes: int | None = None
    mem_available_bytes: int | None = None
    cached_bytes: int | None = None
    swap_total_bytes: int | None = None
    swap_free_bytes: int | None = None
    commit_limit_bytes: int | None = None
    committed_as_bytes: int | None = None
    cma_total_bytes: int | None = None
    cma_free_bytes: int | None = None

    @property
    def commit_headroom_bytes(self) -> int | None:
        """CommitLimit - Committed_AS: what mode-2 overcommit still admits."""
        if self.commit_limit_bytes is None or self.committed_as_bytes is None:
            return None
        return self.commit_limit_bytes - self.committed_as_bytes


_MEMINFO_FIELDS = {
    "MemTotal": "mem_total_bytes",
    "MemFree": "mem_free_bytes",
    "MemAvailable": "mem_available_bytes",
    "Cached": "cached_bytes",
    "SwapTotal": "swap_total_bytes",
    "SwapFree": "swap_free_bytes",
    "CommitLimit": "commit_limit_bytes",
    "Committed_AS": "committed_as_bytes",
    "CmaTotal": "cma_total_bytes",
    "CmaFree": "cma_free_bytes",
}


def parse_meminfo(text: str) -> MemInfo:
    """Parse /proc/meminfo text. Raises ValueError when MemTotal is absent."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep or key not in _MEMINFO_FIELDS:
            continue
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
        values[_MEMINFO_FIELDS[key]] = int(parts[0]) * scale
    if "mem_total_bytes" not in values:
        raise ValueError("no MemTotal line")
    return MemInfo(**values)


def read_text(root: Path, rel: str) -> str:
    """Read ``root/rel`` as text, translating OS errors to HostReadError."""
    path = root / rel.lstrip("/")
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError as err:
        raise HostReadError(path, "missing") from err
    except PermissionError as err:
        raise HostReadError(path, "permission denied") from err
    except OSError as err:
        raise HostReadError(path, err.strerror or str(err)) from err


def read_meminfo(root: Path = ROOT) -> MemInfo:
    text = read_text(root, "proc/meminfo")
    try:
        return parse_meminfo(text)
    except ValueError as err:
        raise HostReadError(root / "proc/meminfo", str(err)) from err
