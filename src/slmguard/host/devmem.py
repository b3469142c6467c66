"""Device memory: what the GPU side of a unified-memory board holds, and what no cgroup sees.

Owns, as pure parsers plus readers under a root: Jetson's **NvMap** clients
(``/sys/kernel/debug/nvmap/iovmm/clients``, root only; the system-wide ``NvMapMemUsed``
is :func:`slmguard.host.procfs.read_meminfo`'s), a process's **DRM clients** (the fdinfo of
its ``/dev/dri`` fds, Documentation/gpu/drm-usage-stats.rst) and
:func:`read_device_memory`, which gathers them with the process's DMA-BUF fds for one
process (the engine), with the reason for each source it could not read.
:attr:`DeviceMemory.outside_cgroup_bytes` is the part its memory cgroup does not count:
nvmap and DMA-BUF pages are the drivers', and so are DRM buffers except shmem-backed ones
(:data:`SHMEM_CHARGED_DRIVERS`). Listing the fds is :mod:`slmguard.host.process`'s, the
system-wide DMA-BUF total :mod:`slmguard.host.dmabuf`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import files, process
from slmguard.host.files import ROOT
from slmguard.host.procfs import MemInfo, read_meminfo

NVMAP_CLIENTS = "sys/kernel/debug/nvmap/iovmm/clients"
# drm_gem_shmem drivers: their buffer pages are shmem allocated in the calling process,
# charged to its memory cgroup (the GPUs of the RK3588 on a mainline kernel, the Pi 5).
SHMEM_CHARGED_DRIVERS = frozenset({"panthor", "panfrost", "lima", "v3d", "etnaviv", "msm"})
MAX_FDS = 4096  # fds looked at per process
_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_DRM_STATS = ("total", "shared", "resident", "purgeable", "active")
_DRM_KEY = re.compile(r"drm-(memory|total|shared|resident|purgeable|active)-([A-Za-z0-9_.]+)")


@dataclass(frozen=True)
class NvmapClient:
    name: str  # the nvmap client's name ("user" for a process)
    process: str  # its comm, "kernel" for the kernel's own
    pid: int
    bytes: int


@dataclass(frozen=True)
class NvmapClients:
    clients: tuple[NvmapClient, ...]
    total_bytes: int  # the driver's own total (shared handles once)

    def pid_bytes(self, pid: int) -> int:
        """What ``pid``'s clients hold (a shared handle counts in each sharer)."""
        return sum(c.bytes for c in self.clients if c.pid == pid)


@dataclass(frozen=True)
class DrmRegion:
    """One memory region of a DRM client (``memory`` is system memory), bytes."""

    name: str
    total: int | None = None
    shared: int | None = None
    resident: int | None = None
    purgeable: int | None = None
    active: int | None = None

    @property
    def held_bytes(self) -> int:
        """Resident where the driver says, else the total it allocated."""
        return self.resident if self.resident is not None else self.total or 0


@dataclass(frozen=True)
class DrmClient:
    driver: str
    client_id: str | None
    pdev: str | None = None
    regions: tuple[DrmRegion, ...] = ()

    @property
    def held_bytes(self) -> int:
        return sum(r.held_bytes for r in self.regions)

    @property
    def charged_to_cgroup(self) -> bool:
        return self.driver in SHMEM_CHARGED_DRIVERS


# ---------------------------------------------------------------- pure parsers


def parse_size(text: str) -> int | None:
    """``123``, ``123 KiB``, ``4 MiB`` (drm-usage-stats) or ``812345K`` (nvmap) in bytes."""
    m = re.fullmatch(r"\s*(\d{1,20})\s*([KMG]iB|[KMG]|B)?\s*", text)
    if m is None:
        return None
    unit = m.group(2) or ""
    scale = _UNITS.get(unit) or _UNITS[unit + "iB"]
    return int(m.group(1)) * scale


def parse_nvmap_clients(text: str) -> NvmapClients:
    """The iovmm clients table. Raises ValueError when it is not one.

    Printed by ``nvmap_debug_clients_show`` in NVIDIA's nvmap driver
    (``drivers/video/tegra/nvmap/nvmap_dev.c``): a ``CLIENT PROCESS PID SIZE`` header,
    one row per client (``user  llama-server  4242  812345K``) and a ``total`` row.
    nvmap pages are the driver's, charged to no memory cgroup: ``MemoryMax`` does not
    bound them.
    """
    lines = text.splitlines()
    if not lines or lines[0].split() != ["CLIENT", "PROCESS", "PID", "SIZE"]:
        raise ValueError("no CLIENT PROCESS PID SIZE header")
    clients: list[NvmapClient] = []
    total: int | None = None
    for line in lines[1:]:
        fields = line.split()
        if fields[:1] == ["total"] and len(fields) == 2:
            total = parse_size(fields[1])
            continue
        if len(fields) != 4 or not fields[2].isdigit():
            continue
        size = parse_size(fields[3])
        if size is not None:
            clients.append(NvmapClient(fields[0], fields[1], int(fields[2]), size))
    if total is None:
        total = sum(c.bytes for c in clients)  # a truncated read: the rows
    return NvmapClients(tuple(clients), total)


def _fdinfo_fields(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() and " " not in key.strip():
            out.setdefault(key.strip(), value.strip())
    return out


def parse_drm_fdinfo(text: str) -> DrmClient | None:
    """The DRM client of one fdinfo file; None when it is not a DRM fd (no drm-driver).

    The keys of drm-usage-stats: ``drm-driver``, ``drm-client-id`` (fds may share one
    client), ``drm-total-<region>``, ``drm-shared-``, ``drm-resident-``,
    ``drm-purgeable-``, ``drm-active-`` and the older ``drm-memory-`` (an alias of
    total), each ``<n>`` with an optional ``KiB``/``MiB`` unit (``drm_print_memory_stats``,
    Linux 6.5+; panthor, panfrost and v3d print them).
    """
    fields = _fdinfo_fields(text)
    driver = fields.get("drm-driver")
    if not driver:
        return None
    stats: dict[str, dict[str, int]] = {}
    for key, value in fields.items():
        m = _DRM_KEY.fullmatch(key)
        size = parse_size(value) if m else None
        if m is None or size is None:
            continue
        stat = "total" if m.group(1) == "memory" else m.group(1)
        stats.setdefault(m.group(2), {}).setdefault(stat, size)
    regions = tuple(
        DrmRegion(name, **{s: v for s, v in values.items() if s in _DRM_STATS})
        for name, values in sorted(stats.items())
    )
    return DrmClient(driver[:64], fields.get("drm-client-id"), fields.get("drm-pdev"), regions)


# ---------------------------------------------------------------- readers


def read_nvmap_clients(root: Path = ROOT) -> NvmapClients | None:
    """The iovmm clients table; None when the kernel has none (not a Jetson, or no
    debugfs). Raises HostReadError when it is there but unreadable (needs root) or garbled."""
    path = root / NVMAP_CLIENTS
    text = files.read(path).optional()
    if text is None:
        return None
    try:
        return parse_nvmap_clients(text)
    except ValueError as err:
        raise HostReadError(path, str(err)) from err


def drm_clients(fdinfo: tuple[tuple[str, str], ...]) -> tuple[DrmClient, ...]:
    """The DRM clients of ``(fd, fdinfo text)`` pairs, each once (fds sharing a
    drm-client-id are one client)."""
    seen: set[tuple[str, str]] = set()
    out: list[DrmClient] = []
    for name, text in fdinfo:
        client = parse_drm_fdinfo(text)
        if client is None:
            continue
        key = (client.driver, client.client_id or f"fd{name}")
        if key not in seen:
            seen.add(key)
            out.append(client)
    return tuple(out)


def read_drm_clients(root: Path, pid: int) -> tuple[DrmClient, ...]:
    """The DRM clients ``pid`` has open, each once; () when it is gone.

    Raises HostReadError when its fd directory cannot be listed."""
    fds = process.read_device_fds(root, pid, MAX_FDS)
    return () if fds is None else drm_clients(fds.drm_fdinfo)


@dataclass(frozen=True)
class DeviceMemory:
    """The device-side memory of one process, by source, and what could not be read."""

    pid: int
    dmabuf_bytes: int | None = None  # its DMA-BUF fds
    nvmap_bytes: int | None = None  # its nvmap clients (debugfs)
    nvmap_system_bytes: int | None = None  # NvMapMemUsed: every nvmap client
    drm: tuple[DrmClient, ...] = ()
    problems: tuple[str, ...] = field(default=())

    @property
    def drm_bytes(self) -> int:
        return sum(c.held_bytes for c in self.drm)

    @property
    def outside_cgroup_bytes(self) -> int:
        """What the process holds that its memory cgroup does not count: DMA-BUF,
        nvmap and the buffers of DRM drivers that are not shmem-backed."""
        drm = sum(c.held_bytes for c in self.drm if not c.charged_to_cgroup)
        return (self.dmabuf_bytes or 0) + (self.nvmap_bytes or 0) + drm


def _nvmap_for(
    root: Path, pid: int, problems: list[str], meminfo: MemInfo | None
) -> tuple[int | None, int | None]:
    """(the pid's nvmap bytes, NvMapMemUsed), each None where unreadable; ``meminfo``:
    the one the caller has just read (read here otherwise)."""
    system = None
    if meminfo is None:
        try:
            meminfo = read_meminfo(root)
        except HostReadError as err:
            problems.append(str(err))
    if meminfo is not None:
        system = meminfo.nvmap_used_bytes
    try:
        clients = read_nvmap_clients(root)
    except HostReadError as err:
        problems.append(str(err))
        return None, system
    return (None if clients is None else clients.pid_bytes(pid)), system


def read_device_memory(
    root: Path, pid: int, *, meminfo: MemInfo | None = None
) -> DeviceMemory | None:
    """``pid``'s device-side memory; None when the process is gone.

    One pass over its fds (:func:`slmguard.host.process.read_device_fds`: a listing and a
    ``readlink`` per fd, fdinfo only for DMA-BUF and DRM fds). ``meminfo``: the
    /proc/meminfo the caller has just read (the governor's sample), for its
    ``NvMapMemUsed``, so that it is not read twice."""
    problems: list[str] = []
    dmabuf: int | None = None
    drm: tuple[DrmClient, ...] = ()
    try:
        fds = process.read_device_fds(root, pid, MAX_FDS)
    except HostReadError as err:
        problems.append(str(err))
    else:
        if fds is None:
            return None
        dmabuf, drm = sum(fds.dmabuf_sizes), drm_clients(fds.drm_fdinfo)
    nvmap, system = _nvmap_for(root, pid, problems, meminfo)
    return DeviceMemory(
        pid,
        dmabuf_bytes=dmabuf,
        nvmap_bytes=nvmap,
        nvmap_system_bytes=system,
        drm=drm,
        problems=tuple(problems),
    )
