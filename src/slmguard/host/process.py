"""One process as the kernel shows it: everything slmguard reads under ``/proc/<pid>``.

Owns ``status`` (VmRSS and its split into RssAnon/RssFile/RssShmem, Linux 4.5+; the peak
VmHWM; ``Cpus_allowed_list``, the set ``sched_getaffinity`` returns), the CPU time of
``stat`` (utime + stime), the commit charge of
``maps`` (what ``vm.overcommit_memory=2`` accounts in ``Committed_AS``), ``limits``
(RLIMIT_MEMLOCK), ``oom_score_adj`` (read, and slmguard's one setter), the descriptors in
``fd`` with their DMA-BUFs and DRM fdinfo, ``comm``, whether it has ended (gone or a
zombie), and the evidence of a stuck process: each thread's ``task/<tid>/stat`` state and
``wchan``, and the kernel ``stack``. Not the
process's cgroup (``cgroup``, ``mountinfo``: :mod:`slmguard.host.cgroup`) nor its CPU's
capability words (``auxv``: :mod:`slmguard.host.cpufeatures`). Readers take ``root`` and
``pid`` and return ``None`` (or ``()``) for a process that is gone: processes exit between
being listed and being read.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import files
from slmguard.host.files import ROOT
from slmguard.host.systemd import parse_cpu_set

log = logging.getLogger(__name__)

_STATUS_BYTES = {
    "VmRSS": "rss_bytes",
    "VmHWM": "hwm_bytes",
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
    hwm_bytes: int | None = None  # VmHWM: the peak RSS since the process started
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
    return files.read(root / "proc" / str(pid) / name).text


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


# ---------------------------------------------------------------- /proc/<pid>/limits


@dataclass(frozen=True)
class RLimit:
    """A resource limit; ``None`` means unlimited."""

    soft: int | None
    hard: int | None


def parse_limits(text: str) -> dict[str, RLimit]:
    """Parse /proc/<pid>/limits into {"Max locked memory": RLimit(...), ...}.

    Columns are fixed-width (name padded to 26 characters, then soft, hard, units).
    """
    out: dict[str, RLimit] = {}
    for line in text.splitlines()[1:]:
        name, rest = line[:26].strip(), line[26:].split()
        if not name or len(rest) < 2:
            continue

        def value(word: str) -> int | None:
            return None if word == "unlimited" else int(word)

        try:
            out[name] = RLimit(value(rest[0]), value(rest[1]))
        except ValueError:
            continue
    return out


def read_memlock_limit(root: Path = ROOT, pid: int | str = "self") -> RLimit:
    """RLIMIT_MEMLOCK of ``pid`` in bytes (what mlock() may pin without CAP_IPC_LOCK)."""
    path = root / "proc" / str(pid) / "limits"
    limits = parse_limits(files.read(path).require())
    if "Max locked memory" not in limits:
        raise HostReadError(path, "no 'Max locked memory' line")
    return limits["Max locked memory"]


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
    return files.read(f"{fdinfo_dir}/{name}", MAX_FDINFO_BYTES).text  # None: closed since


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
    stat = files.read(f"{proc}/stat")
    if stat.absent:
        return None
    # A zombie (exited, not yet reaped by its parent) still has a /proc entry.
    state = parse_stat_state(stat.require())
    if state is not None and state[1] in ("Z", "X"):
        return None
    try:
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
    comm = files.read(root / "proc" / str(pid) / "comm").optional()
    if comm is None:
        return None
    sizes = fds.dmabuf_sizes
    return FdCounts(pid, comm.strip(), fds.fd_count, len(sizes), sum(sizes))


# ---------------------------------------------------------------- threads and kernel stack


@dataclass(frozen=True)
class ThreadState:
    tid: int
    name: str
    state: str  # one letter: R running, S sleeping, D uninterruptible, T stopped, Z zombie
    wchan: str | None  # the kernel function it sleeps in ("0": running); None: unreadable


def parse_stat_state(text: str) -> tuple[str, str] | None:
    """(comm, state) from a ``stat`` line; ``comm`` may hold spaces and parentheses."""
    start, end = text.find("("), text.rfind(")")
    if start < 0 or end < start:
        return None
    rest = text[end + 1 :].split()
    if not rest:
        return None
    return text[start + 1 : end], rest[0]


def parse_cpu_ticks(text: str) -> int | None:
    """utime + stime (fields 14 and 15 of ``stat``, USER_HZ ticks: the units of
    ``/proc/stat``); None when the line is not a stat line."""
    end = text.rfind(")")
    rest = text[end + 1 :].split() if end >= 0 else []
    if len(rest) < 13 or not (rest[11].isdigit() and rest[12].isdigit()):
        return None
    return int(rest[11]) + int(rest[12])


def read_cpu_ticks(root: Path, pid: int | str = "self") -> int | None:
    """``pid``'s CPU time so far in ticks; None when it is gone or unreadable."""
    text = _proc_text(root, pid, "stat")
    return None if text is None else parse_cpu_ticks(text)


def has_ended(root: Path, pid: int) -> bool:
    """Whether ``pid`` has exited as far as the kernel shows: gone from ``/proc``, or a
    zombie (``Z``, ``X``) whose status nobody has collected yet."""
    text = _proc_text(root, pid, "stat")
    parsed = parse_stat_state(text) if text is not None else None
    return parsed is None or parsed[1] in ("Z", "X")


def read_thread_states(root: Path, pid: int, limit: int = 256) -> tuple[ThreadState, ...]:
    """Every thread of ``pid`` (at most ``limit``), in tid order; empty when it is gone.

    Never raises: this runs when something is already wrong (a stalled engine).
    ``wchan`` needs ptrace access to the process; what cannot be read is None.
    """
    task = root / "proc" / str(pid) / "task"
    try:
        tids = sorted(int(p.name) for p in task.iterdir() if p.name.isdigit())
    except OSError:
        return ()
    out = []
    for tid in tids[:limit]:
        stat = files.read(task / str(tid) / "stat").text
        parsed = parse_stat_state(stat) if stat is not None else None
        if parsed is None:
            continue
        wchan = files.read(task / str(tid) / "wchan").text
        out.append(ThreadState(tid, parsed[0], parsed[1], wchan.strip() if wchan else None))
    return tuple(out)


def read_kernel_stack(root: Path, pid: int) -> str | None:
    """``/proc/<pid>/stack`` (root only, and only with ``CONFIG_STACKTRACE``); None when
    it cannot be read."""
    return files.read(root / "proc" / str(pid) / "stack").text
