"""One process as the kernel shows it under ``/proc/<pid>``.

Owns the parse of ``/proc/<pid>/status`` (VmRSS and its split into RssAnon,
RssFile, RssShmem, present since Linux 4.5; ``Cpus_allowed_list``, the set
``sched_getaffinity`` returns), the commit charge of ``/proc/<pid>/maps`` (its
private writable mappings: what ``vm.overcommit_memory=2`` accounts in
``Committed_AS``), ``/proc/<pid>/oom_score_adj`` (read, and the
one setter slmguard has: a process may raise its own value freely, lowering it
needs CAP_SYS_RESOURCE), and the open descriptors in ``/proc/<pid>/fd`` with
the DMA-BUFs among them (``/proc/<pid>/fdinfo/<n>``). System-wide DMA-BUF
totals are :mod:`slmguard.host.dmabuf`; cgroup membership is
:mod:`slmguard.host.cgroup`.

Parsers take text; readers take a ``root`` (tests point it at a tree) and
return ``None`` for a process that is gone, because processes exit between
being listed and being read.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host.procfs import ROOT
from slmguard.host.systemd import parse_cpu_set

log = logging.getLogger(__name__)

_STATUS_BYTES = {
    "VmRSS": "rss_bytes",
    "RssAnon": "rss_anon_bytes",
    "RssFile": "rss_file_bytes",
    "RssShmem": "rss_shmem_bytes",
}


@dataclass(frozen=True)
class ProcessStatus:
    """Selected ``/proc/<pid>/status`` lines; ``None`` where the kernel printed none.

    Kernel threads have no VmRSS; kernels before 4.5 have no Rss* split.
    """

    rss_bytes: int | None = None
    rss_anon_bytes: int | None = None
    rss_file_bytes: int | None = None
    rss_shmem_bytes: int | None = None
    cpus_allowed: tuple[int, ...] = ()  # Cpus_allowed_list; () when absent

    @property
    def private_bytes(self) -> int:
        """RssAnon + RssShmem: what the process holds that no file backs (0 when unknown).

        Mapped file pages (the GGUF) are RssFile and can be dropped and re-read,
        so they are not counted; shmem cannot, so it is.
        """
        return (self.rss_anon_bytes or 0) + (self.rss_shmem_bytes or 0)


def parse_status(text: str) -> ProcessStatus:
    """Parse ``/proc/<pid>/status`` text (``Key:\\tvalue [kB]`` lines)."""
    values: dict[str, int] = {}
    cpus: tuple[int, ...] = ()
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        if key == "Cpus_allowed_list":
            cpus = parse_cpu_set(rest)
        elif key in _STATUS_BYTES:
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[_STATUS_BYTES[key]] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
    return ProcessStatus(**values, cpus_allowed=cpus)


def _proc_text(root: Path, pid: int | str, name: str) -> str | None:
    """``/proc/<pid>/<name>`` as text; None when the process is gone or the file unreadable."""
    try:
        return (root / "proc" / str(pid) / name).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def read_status(root: Path = ROOT, pid: int | str = "self") -> ProcessStatus | None:
    """``pid``'s status; None when the process is gone or its status unreadable."""
    text = _proc_text(root, pid, "status")
    return None if text is None else parse_status(text)


# ---------------------------------------------------------------- commit charge


def parse_commit_bytes(maps_text: str) -> int:
    """The bytes of the private writable mappings in ``/proc/<pid>/maps`` text.

    The kernel charges these to ``Committed_AS`` when they are mapped (a private
    mapping made writable later is charged then, so it is writable here too);
    shared and read-only mappings are not charged.
    """
    total = 0
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=2)
        if len(fields) < 2 or len(fields[1]) != 4:
            continue
        perms = fields[1]
        if perms[1] != "w" or perms[3] != "p":
            continue
        start, sep, end = fields[0].partition("-")
        try:
            total += max(0, int(end, 16) - int(start, 16)) if sep else 0
        except ValueError:
            continue
    return total


def read_commit_bytes(root: Path = ROOT, pid: int | str = "self") -> int | None:
    """``pid``'s commit charge; None when the process is gone or its maps unreadable."""
    text = _proc_text(root, pid, "maps")
    return None if text is None else parse_commit_bytes(text)


# ---------------------------------------------------------------- oom_score_adj


def read_oom_score_adj(root: Path = ROOT, pid: int | str = "self") -> int | None:
    """``pid``'s oom_score_adj (-1000..1000); None when gone or unreadable."""
    text = _proc_text(root, pid, "oom_score_adj")
    try:
        return None if text is None else int(text.strip())
    except ValueError:
        return None


def set_oom_score_adj(value: int, root: Path = ROOT, *, who: str = "this process") -> bool:
    """Set this process's oom_score_adj; False (logged with the value kept) when denied.

    Raising it is always allowed; lowering it below the value inherited needs
    CAP_SYS_RESOURCE, so a service without it keeps what systemd gave it
    (``OOMScoreAdjust=``). Never raises: the caller runs either way.
    """
    try:
        (root / "proc/self/oom_score_adj").write_text(f"{value}\n", encoding="ascii")
    except OSError as err:
        kept = read_oom_score_adj(root)
        if err.errno in (errno.EPERM, errno.EACCES):  # expected without the capability
            log.info(
                "%s keeps oom_score_adj %s: lowering it to %d needs CAP_SYS_RESOURCE, "
                "which the unit `slmguard apply` writes sets with OOMScoreAdjust=",
                who,
                "unknown" if kept is None else kept,
                value,
            )
            return False
        log.warning(
            "%s keeps oom_score_adj %s (setting %d: %s)",
            who,
            "unknown" if kept is None else kept,
            value,
            err.strerror or err,
        )
        return False
    return True


# ---------------------------------------------------------------- descriptors


@dataclass(frozen=True)
class FdCounts:
    """Open descriptors of one process; the DMA-BUF ones counted separately."""

    pid: int
    comm: str
    fd_count: int
    dmabuf_count: int
    dmabuf_bytes: int


def parse_fdinfo_dmabuf(text: str) -> int | None:
    """The size in bytes of a DMA-BUF's fdinfo (it has ``exp_name:``), else None.

    dma_buf_show_fdinfo() prints ``size:``, ``count:``, ``exp_name:`` (and
    ``name:`` since 5.x); a file without ``exp_name`` is not a DMA-BUF.
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    if "exp_name" not in fields:
        return None
    size = fields.get("size", "0")
    return int(size) if size.isdigit() else 0


def _is_dead(stat_text: str) -> bool:
    # The state follows the parenthesised comm, which may itself hold ")".
    return stat_text[stat_text.rfind(")") + 2 :][:1] in ("Z", "X")


MAX_FDINFO_BYTES = 16 << 10  # an fdinfo read is bounded (a DRM client's is < 2 KiB)


@dataclass(frozen=True)
class DeviceFds:
    """One pass over a process's descriptors: how many, the DMA-BUF sizes and the raw
    fdinfo of its DRM fds (links into ``/dev/dri/``, as ``(fd, text)``; parsed by
    :mod:`slmguard.host.devmem`). ``max_fds`` bounds the fds looked at (the lowest
    numbers); ``fd_count`` is every fd."""

    pid: int
    fd_count: int
    dmabuf_sizes: tuple[int, ...]
    drm_fdinfo: tuple[tuple[str, str], ...]


def _fdinfo(fdinfo_dir: str, name: str) -> str | None:
    try:
        with open(f"{fdinfo_dir}/{name}", "rb") as fh:
            return fh.read(MAX_FDINFO_BYTES).decode("utf-8", "replace")
    except OSError:
        return None  # closed since the listing


def _fd_targets(proc: str, max_fds: int | None) -> tuple[int, list[tuple[str, str]]]:
    """(every fd, [(fd, link target)] of the first ``max_fds``): one listing and one
    ``readlink`` per fd, relative to the directory's own descriptor (the per-fd cost is
    the kernel's; it is the whole price of a sample on a process with many fds)."""
    dir_fd = os.open(f"{proc}/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        names = os.listdir(dir_fd)
        count = len(names)
        if max_fds is not None and count > max_fds:
            names = sorted(names, key=lambda n: (len(n), n))[:max_fds]
        out = []
        for name in names:
            try:
                out.append((name, os.readlink(name, dir_fd=dir_fd)))
            except OSError:
                out.append((name, ""))  # closed since the listing
        return count, out
    finally:
        os.close(dir_fd)


def read_device_fds(root: Path, pid: int, max_fds: int | None = None) -> DeviceFds | None:
    """``pid``'s descriptors with its DMA-BUFs and DRM fds, in one pass; None when it is
    gone (or a zombie).

    Raises HostReadError when its fd directory exists but cannot be listed
    (another user's process without CAP_SYS_PTRACE).
    """
    proc = f"{os.fspath(root)}/proc/{pid}"
    try:
        with open(f"{proc}/stat", encoding="utf-8", errors="replace") as fh:
            # A zombie (exited, not yet reaped by its parent) still has a /proc entry.
            if _is_dead(fh.read()):
                return None
        count, targets = _fd_targets(proc, max_fds)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise HostReadError(Path(proc) / "fd", err.strerror or str(err)) from err
    sizes: list[int] = []
    drm: list[tuple[str, str]] = []
    for name, target in targets:
        # DRM fds link to their node; dma-buf files to "/dmabuf:<name>" (5.x+) or
        # "anon_inode:dmabuf"; under a test root the link is a plain file named like that.
        is_drm = target.startswith("/dev/dri/")
        if not is_drm and "dmabuf" not in target and not name.startswith("dmabuf"):
            continue
        info = _fdinfo(f"{proc}/fdinfo", name)
        if info is None:
            continue
        if is_drm:
            drm.append((name, info))
        else:
            size = parse_fdinfo_dmabuf(info)
            if size is not None:
                sizes.append(size)
    return DeviceFds(pid, count, tuple(sizes), tuple(drm))


def read_fd_counts(root: Path, pid: int) -> FdCounts | None:
    """fd and DMA-BUF counts of ``pid``; None when it is gone (or a zombie).

    Raises HostReadError when its fd directory exists but cannot be listed
    (another user's process without CAP_SYS_PTRACE).
    """
    fds = read_device_fds(root, pid)
    if fds is None:
        return None
    try:
        comm = (root / "proc" / str(pid) / "comm").read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as err:
        raise HostReadError(root / "proc" / str(pid) / "comm", err.strerror or str(err)) from err
    sizes = fds.dmabuf_sizes
    return FdCounts(pid, comm.strip(), fds.fd_count, len(sizes), sum(sizes))
