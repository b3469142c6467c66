"""The system-wide ``/proc`` files: meminfo, swaps, sysctl, cmdline, device tree, uptime, load.

Owns ``/proc/meminfo`` (``parse_meminfo``, the one meminfo parser, with every field a verb
uses; keys the kernel did not print stay ``None``: CmaTotal/CmaFree only with CONFIG_CMA,
MemAvailable since Linux 3.14, Hugetlb since 4.16, NvMapMemUsed/NvMapMemFree only on
NVIDIA's L4T kernels), ``/proc/swaps``, ``/proc/sys/*`` (sysctl), ``/proc/cmdline``
(split by :mod:`slmguard.host.kernelargs`), ``/proc/device-tree`` (``model``,
``compatible``), ``/proc/uptime`` and ``/proc/loadavg``, each a pure parser plus a
reader taking a root.
Not ``/proc/<pid>`` (:mod:`slmguard.host.process`) nor ``/proc/pressure``
(:mod:`slmguard.host.psi`); files are read through :func:`slmguard.host.files.read`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import files, kernelargs
from slmguard.host.files import ROOT as ROOT  # re-exported: plan and serve take it from here


@dataclass(frozen=True)
class MemInfo:
    """The /proc/meminfo values the verbs use, in bytes (the file says kB, meaning KiB).

    ``HugePages_Total`` is a count (the kernel prints no unit after it).
    """

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
    hugetlb_all_sizes_bytes: int | None = None  # Hugetlb: (Linux >= 4.16)
    hugepages_total: int | None = None  # HugePages_Total: a count of default-size pages
    hugepage_size_bytes: int | None = None  # Hugepagesize: the default size
    # NVIDIA's L4T kernels (Jetson): memory the nvmap driver holds for the GPU and the
    # other engines, outside every process and cgroup (slmguard.host.devmem).
    nvmap_used_bytes: int | None = None
    nvmap_free_bytes: int | None = None

    @property
    def hugetlb_bytes(self) -> int:
        """Bytes reserved as huge pages, which CommitLimit leaves out (0 when none).

        ``Hugetlb:`` counts every page size (Linux >= 4.16); older kernels print
        only the default size's ``HugePages_Total * Hugepagesize``. A kernel
        without CONFIG_HUGETLBFS prints neither and reserves none.
        """
        if self.hugetlb_all_sizes_bytes is not None:
            return self.hugetlb_all_sizes_bytes
        if self.hugepages_total is not None and self.hugepage_size_bytes is not None:
            return self.hugepages_total * self.hugepage_size_bytes
        return 0

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
    "Hugetlb": "hugetlb_all_sizes_bytes",
    "HugePages_Total": "hugepages_total",
    "Hugepagesize": "hugepage_size_bytes",
    "NvMapMemUsed": "nvmap_used_bytes",
    "NvMapMemFree": "nvmap_free_bytes",
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


def read_meminfo(root: Path = ROOT) -> MemInfo:
    text = files.read(root / "proc/meminfo").require()
    try:
        return parse_meminfo(text)
    except ValueError as err:
        raise HostReadError(root / "proc/meminfo", str(err)) from err


# ---------------------------------------------------------------- /proc/swaps


@dataclass(frozen=True)
class SwapArea:
    """One active swap area from /proc/swaps (sizes are printed in KiB)."""

    filename: str
    kind: str  # "partition" | "file"
    size_bytes: int
    used_bytes: int
    priority: int

    @property
    def is_zram(self) -> bool:
        return Path(self.filename).name.startswith("zram")


def parse_swaps(text: str) -> tuple[SwapArea, ...]:
    """Parse /proc/swaps. The header line and malformed lines are skipped.

    Paths with spaces are printed with the space escaped as ``\\040``.
    """
    out: list[SwapArea] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 5 or parts[0] == "Filename":
            continue
        try:
            size, used, prio = int(parts[2]), int(parts[3]), int(parts[4])
        except ValueError:
            continue
        out.append(
            SwapArea(parts[0].replace("\\040", " "), parts[1], size * 1024, used * 1024, prio)
        )
    return tuple(out)


def read_swaps(root: Path = ROOT) -> tuple[SwapArea, ...]:
    """Active swap areas; a kernel without CONFIG_SWAP has no /proc/swaps (HostReadError)."""
    return parse_swaps(files.read(root / "proc/swaps").require())


# ---------------------------------------------------------------- sysctl


def sysctl_path(name: str) -> str:
    """``vm.swappiness`` -> ``proc/sys/vm/swappiness`` (relative to a root)."""
    return "proc/sys/" + name.replace(".", "/")


def read_sysctl(root: Path, name: str) -> str:
    """The value of a sysctl as text, stripped."""
    return files.read(root / sysctl_path(name)).require().strip()


def read_sysctl_int(root: Path, name: str) -> int:
    """The value of an integer sysctl; HostReadError when missing or not an integer."""
    text = read_sysctl(root, name)
    try:
        return int(text)
    except ValueError as err:
        raise HostReadError(root / sysctl_path(name), f"not an integer: {text[:40]!r}") from err


# ---------------------------------------------------------------- /proc/cmdline


def parse_cmdline(text: str) -> tuple[str, ...]:
    """Kernel arguments; whitespace separates them except inside double quotes."""
    return kernelargs.tokens(text.strip().replace("\x00", " "))


def read_cmdline(root: Path = ROOT) -> tuple[str, ...]:
    return parse_cmdline(files.read(root / "proc/cmdline").require())


# ---------------------------------------------------------------- device tree


def read_device_tree_model(root: Path = ROOT) -> str | None:
    """The board name from /proc/device-tree/model (NUL-terminated); None without a device tree."""
    text = files.read(root / "proc/device-tree/model").optional()
    return None if text is None else text.rstrip("\x00\n").strip() or None


def read_device_tree_strings(root: Path, name: str) -> tuple[str, ...]:
    """``/proc/device-tree/<name>`` as its NUL-separated strings (``compatible`` lists
    several, most specific first), blanks dropped; () without a device tree or that node,
    HostReadError when it is there but cannot be read."""
    text = files.read(root / "proc/device-tree" / name).optional()
    return () if text is None else tuple(s.strip() for s in text.split("\x00") if s.strip())


def parse_uptime(text: str) -> float:
    """Seconds since boot: the first field of /proc/uptime. Raises ValueError."""
    return float(text.split()[0])


def read_uptime_s(root: Path = ROOT) -> float | None:
    """The root's uptime in seconds, or ``None`` when /proc/uptime is absent or garbled.

    Kernel log timestamps count from boot too, so this is the "now" to compare
    them with; a fixture tree without the file has no clock at all.
    """
    text = files.read(root / "proc/uptime").text
    try:
        return None if text is None else parse_uptime(text)
    except (ValueError, IndexError):
        return None


def parse_loadavg(text: str) -> tuple[float, float, float] | None:
    """``/proc/loadavg``'s first three fields (1, 5 and 15 minutes); None when garbled."""
    try:
        one, five, fifteen = (float(w) for w in text.split()[:3])
    except ValueError:
        return None
    if not all(0 <= v < 1e6 for v in (one, five, fifteen)):
        return None
    return one, five, fifteen


def read_loadavg(root: Path = ROOT) -> tuple[float, float, float] | None:
    """The load averages, or ``None`` when /proc/loadavg is absent or garbled."""
    text = files.read(root / "proc/loadavg").text
    return None if text is None else parse_loadavg(text)
