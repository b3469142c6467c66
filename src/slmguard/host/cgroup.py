"""The memory cgroup of a process, cgroup v1 or v2, behind one facade.

Owns finding a process's cgroup directories (``/proc/<pid>/cgroup`` plus ``mountinfo``:
the memory one, and every controller's for :mod:`slmguard.host.cpu`), a unit's cgroup,
a cgroup's kernel path and processes, the mount layout, telling v1 from v2, and reading
one cgroup's memory files into a :class:`CgroupMemory` snapshot; the two hierarchies
name the same facts differently and the facade maps them (the table above the file
names). It does not create, write or move cgroups (tests use ``tests/realcgroup.py``,
deployment uses systemd), nor read anything else of the process
(:mod:`slmguard.host.process`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import files
from slmguard.host.files import ROOT

#   fact           v2 (admin-guide/cgroup-v2.rst)   v1 (admin-guide/cgroup-v1/memory.rst)
#   usage          memory.current                   memory.usage_in_bytes
#   inactive file  memory.stat inactive_file        memory.stat total_inactive_file
#   soft limit     memory.high (max = none)         (no equivalent: None)
#   hard limit     memory.max (max = none)          memory.limit_in_bytes
#   events         memory.events                    memory.oom_control + memory.failcnt

# cgroup v2 file names
V2_CURRENT = "memory.current"
V2_HIGH = "memory.high"
V2_MAX = "memory.max"
V2_EVENTS = "memory.events"
V2_STAT = "memory.stat"
V2_PRESSURE = "memory.pressure"
V2_CONTROLLERS = "cgroup.controllers"
V2_SUBTREE_CONTROL = "cgroup.subtree_control"

# cgroup v1 file names
V1_USAGE = "memory.usage_in_bytes"
V1_LIMIT = "memory.limit_in_bytes"
V1_FAILCNT = "memory.failcnt"
V1_OOM_CONTROL = "memory.oom_control"
V1_STAT = "memory.stat"

# proc files
PROC_CGROUP = "cgroup"
PROC_MOUNTINFO = "mountinfo"

# every cgroup directory, v1 or v2, lists its member processes here
PROCS = "cgroup.procs"

# v1 shows this file in a hierarchy's root cgroup only (CFTYPE_ONLY_ON_ROOT in
# kernel/cgroup/cgroup-v1.c), whatever cgroup namespace reads it
V1_ROOT_ONLY = "cgroup.sane_behavior"

# Where distributions mount the hierarchies; used when mountinfo is unreadable.
DEFAULT_V2_MOUNT = "sys/fs/cgroup"
DEFAULT_V1_MEMORY_MOUNT = "sys/fs/cgroup/memory"

# v1 prints "unlimited" as the largest page-aligned long (9223372036854771712 with 4 KiB
# pages, a little less with 64 KiB pages): anything at or above 2**62 is unlimited.
V1_UNLIMITED_FLOOR = 2**62


@dataclass(frozen=True)
class CgroupMemory:
    """One memory cgroup's state, read once. ``None`` where the kernel did not say."""

    version: int
    path: Path
    usage_bytes: int | None
    inactive_file_bytes: int | None
    high_bytes: int | None
    max_bytes: int | None
    events: Mapping[str, int] = field(default_factory=dict)
    stat: Mapping[str, int] = field(default_factory=dict)

    @property
    def working_set_bytes(self) -> int | None:
        """usage - inactive_file, floored at 0: the kubelet's working set.

        Inactive page cache (for example the cold part of a mapped GGUF) is
        reclaimed before the cgroup hits its limit, so it is not counted.
        """
        if self.usage_bytes is None:
            return None
        return max(0, self.usage_bytes - (self.inactive_file_bytes or 0))

    @property
    def limit_candidates(self) -> tuple[tuple[int | None, str], ...]:
        """The limits that bound this cgroup, each named by the file that set it.

        v2: memory.high and memory.max. v1: memory.limit_in_bytes and the
        ``hierarchical_memory_limit`` of memory.stat, where v1 reports the
        smallest limit of the cgroup and its ancestors.
        """
        if self.version == 2:
            return ((self.high_bytes, V2_HIGH), (self.max_bytes, V2_MAX))
        hier = self.stat.get("hierarchical_memory_limit")
        if hier is not None and hier >= V1_UNLIMITED_FLOOR:
            hier = None
        return ((self.max_bytes, V1_LIMIT), (hier, "hierarchical_memory_limit"))

    @property
    def limit_bytes(self) -> int | None:
        """The smallest of this cgroup's own memory.high and memory.max (None: unlimited).

        An ancestor's smaller v1 limit is not included: see :attr:`limit_candidates`.
        """
        set_limits = [v for v in (self.high_bytes, self.max_bytes) if v is not None]
        return min(set_limits) if set_limits else None

    @property
    def oom_kill_count(self) -> int | None:
        """OOM kills inside this cgroup (v2 memory.events, v1 memory.oom_control >= 4.13)."""
        return self.events.get("oom_kill")


@dataclass(frozen=True)
class CgroupMembership:
    """One line of /proc/<pid>/cgroup: ``hierarchy-id:controllers:path``."""

    hierarchy_id: int
    controllers: tuple[str, ...]
    path: str


@dataclass(frozen=True)
class CgroupMount:
    """A cgroup or cgroup2 mount from mountinfo."""

    fstype: str  # "cgroup" (v1) or "cgroup2"
    mount_point: str  # absolute, as the kernel printed it (octal escapes decoded)
    mount_root: str  # the hierarchy directory mounted there (a subdir in containers)
    options: tuple[str, ...]  # super options; for v1 these name the controllers


# ---------------------------------------------------------------- pure parsers


def parse_memory_stat(text: str) -> dict[str, int]:
    """Parse ``key value`` lines (memory.stat, memory.events, memory.oom_control).

    Lines that are not a key and an integer are skipped, so a truncated file
    yields the lines that were complete.
    """
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        try:
            out[parts[0]] = int(parts[1])
        except ValueError:
            continue
    return out


def parse_limit(text: str, version: int) -> int | None:
    """Parse a limit file: ``max`` (v2) or a huge page-aligned value (v1) -> None."""
    value = text.strip()
    if value == "max":
        return None
    number = int(value)  # ValueError on garbage, translated by the reader
    if version == 1 and number >= V1_UNLIMITED_FLOOR:
        return None
    return number


def parse_proc_cgroup(text: str) -> list[CgroupMembership]:
    """Parse /proc/<pid>/cgroup. v2 is the line with id 0 and no controllers."""
    out: list[CgroupMembership] = []
    for line in text.splitlines():
        ident, sep1, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep1 and sep2) or not ident.strip().isdigit():
            continue
        names = tuple(c for c in controllers.split(",") if c)
        out.append(CgroupMembership(int(ident), names, path))
    return out


def _unescape_mount(field_text: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field_text):
        if field_text[i] == "\\" and field_text[i + 1 : i + 4].isdigit():
            out.append(chr(int(field_text[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field_text[i])
            i += 1
    return "".join(out)


def parse_mountinfo_cgroups(text: str) -> list[CgroupMount]:
    """The cgroup and cgroup2 mounts in /proc/<pid>/mountinfo (proc(5) format).

    ``id parent maj:min root mount-point options [optional...] - fstype source super-options``
    """
    out: list[CgroupMount] = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 5 or len(fields) < sep + 3:
            continue
        fstype = fields[sep + 1]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        out.append(
            CgroupMount(
                fstype=fstype,
                mount_point=_unescape_mount(fields[4]),
                mount_root=_unescape_mount(fields[3]),
                options=tuple(fields[sep + 3].split(",")),
            )
        )
    return out


def _join_cgroup_path(mount: CgroupMount, cgroup_path: str) -> str:
    """mount point + the part of the cgroup path below the mounted hierarchy root."""
    root = mount.mount_root.rstrip("/")
    if root and (cgroup_path == root or cgroup_path.startswith(root + "/")):
        cgroup_path = cgroup_path[len(root) :]
    # Under a cgroup namespace the path may start with "/.." (outside our view):
    # there is nothing below the mount to point at, so use the mount itself.
    if cgroup_path.startswith("/.."):
        cgroup_path = "/"
    return mount.mount_point.rstrip("/") + "/" + cgroup_path.strip("/")


def locate_memory_cgroup(
    memberships: list[CgroupMembership],
    mounts: list[CgroupMount],
    v2_controllers: str | None,
) -> tuple[int, str] | None:
    """Pure decision: (version, absolute dir) of the memory cgroup, or None.

    A v1 memory hierarchy wins when present (hybrid hosts put memory on v1 and
    leave the v2 mount without it). v2 counts only when its root
    cgroup.controllers (``v2_controllers``) lists ``memory``. An empty ``mounts``
    (mountinfo unreadable) falls back to the usual /sys/fs/cgroup locations.
    """
    for m in memberships:
        if m.hierarchy_id != 0 and "memory" in m.controllers:
            mount = next(
                (x for x in mounts if x.fstype == "cgroup" and "memory" in x.options), None
            )
            if mount is None:
                if mounts:
                    return None
                mount = CgroupMount("cgroup", "/" + DEFAULT_V1_MEMORY_MOUNT, "/", ("memory",))
            return 1, _join_cgroup_path(mount, m.path)
    for m in memberships:
        if m.hierarchy_id == 0 and not m.controllers:
            if v2_controllers is None or "memory" not in v2_controllers.split():
                return None
            mount2 = next((x for x in mounts if x.fstype == "cgroup2"), None)
            if mount2 is None:
                if mounts:
                    return None
                mount2 = CgroupMount("cgroup2", "/" + DEFAULT_V2_MOUNT, "/", ())
            return 2, _join_cgroup_path(mount2, m.path)
    return None


# ---------------------------------------------------------------- readers


def _read_optional(path: Path) -> str | None:
    """File text, None when the file does not exist; other OS errors raise HostReadError."""
    return files.read(path).optional()


def _v2_mount_point(mounts: list[CgroupMount]) -> str:
    mount2 = next((x for x in mounts if x.fstype == "cgroup2"), None)
    return mount2.mount_point if mount2 else "/" + DEFAULT_V2_MOUNT


def _locate(root: Path, pid: int | str) -> tuple[int, Path] | None:
    proc = root / "proc" / str(pid)
    cgroup_text = _read_optional(proc / PROC_CGROUP)
    if cgroup_text is None:
        return None
    memberships = parse_proc_cgroup(cgroup_text)
    mounts = parse_mountinfo_cgroups(_read_optional(proc / PROC_MOUNTINFO) or "")
    v2_root = root / _v2_mount_point(mounts).lstrip("/")
    v2_controllers = _read_optional(v2_root / V2_CONTROLLERS)
    found = locate_memory_cgroup(memberships, mounts, v2_controllers)
    if found is None:
        return None
    version, absolute = found
    return version, root / absolute.lstrip("/")


def memory_cgroup_dir(root: Path = ROOT, pid: int | str = "self") -> Path | None:
    """The memory cgroup directory of ``pid`` under ``root``; None without a memory controller.

    Raises HostReadError only when a file exists but cannot be read.
    """
    found = _locate(root, pid)
    return found[1] if found else None


def memory_cgroup_version(root: Path = ROOT) -> int | None:
    """2 or 1 for the hierarchy holding the memory controller, None when there is none."""
    found = _locate(root, "self")
    return found[0] if found else None


def _detect_version(cgroup_dir: Path) -> int:
    if (cgroup_dir / V2_CURRENT).exists() or (cgroup_dir / V2_MAX).exists():
        return 2
    if (cgroup_dir / V1_USAGE).exists():
        return 1
    # The v2 root cgroup has no memory.current/max but has memory.stat (5.x+).
    if (cgroup_dir / V2_CONTROLLERS).exists() and (cgroup_dir / V2_STAT).exists():
        return 2
    if not cgroup_dir.is_dir():
        raise HostReadError(cgroup_dir, "no such cgroup directory")
    raise HostReadError(cgroup_dir, "no memory controller files (neither v2 nor v1)")


def counts_own_memory(cgroup_dir: Path) -> bool:
    """Whether the cgroup's memory usage is its own processes' alone.

    Not in a hierarchy's root cgroup, where a process no manager gave a cgroup of
    its own lives: v1's root usage counts every process of the host (the root
    alone has ``cgroup.sane_behavior``), v2's root has no memory.current. Nor in a
    v2 cgroup whose parent does not enable the memory controller (no memory.current
    either). A container's own cgroup seen through its cgroup namespace (mounted at
    /sys/fs/cgroup, ``/`` in /proc/self/cgroup) is not the root and counts its own.
    A directory that is neither is left to :func:`read_memory` to refuse.
    """
    if (cgroup_dir / V1_USAGE).exists():
        return not (cgroup_dir / V1_ROOT_ONLY).exists()
    if (cgroup_dir / V2_CONTROLLERS).exists():
        return (cgroup_dir / V2_CURRENT).exists()
    return True


def _parse_int_file(path: Path, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError as err:
        raise HostReadError(path, f"not an integer: {text.strip()[:40]!r}") from err


def _parse_limit_file(path: Path, text: str | None, version: int) -> int | None:
    if text is None:
        return None
    try:
        return parse_limit(text, version)
    except ValueError as err:
        raise HostReadError(path, f"not a limit: {text.strip()[:40]!r}") from err


def read_memory(cgroup_dir: Path) -> CgroupMemory:
    """Read one memory cgroup; the version is detected from the files present.

    Files that do not exist give None (or an empty mapping); a directory with
    neither v1 nor v2 memory files, an unreadable file or a garbled number
    raises HostReadError naming the file.
    """
    version = _detect_version(cgroup_dir)
    stat_text = _read_optional(cgroup_dir / (V2_STAT if version == 2 else V1_STAT))
    stat = parse_memory_stat(stat_text or "")
    if version == 2:
        current = cgroup_dir / V2_CURRENT
        high = cgroup_dir / V2_HIGH
        maximum = cgroup_dir / V2_MAX
        return CgroupMemory(
            version=2,
            path=cgroup_dir,
            usage_bytes=_parse_int_file(current, _read_optional(current)),
            inactive_file_bytes=stat.get("inactive_file"),
            high_bytes=_parse_limit_file(high, _read_optional(high), 2),
            max_bytes=_parse_limit_file(maximum, _read_optional(maximum), 2),
            events=parse_memory_stat(_read_optional(cgroup_dir / V2_EVENTS) or ""),
            stat=stat,
        )
    usage = cgroup_dir / V1_USAGE
    limit = cgroup_dir / V1_LIMIT
    failcnt = cgroup_dir / V1_FAILCNT
    events: dict[str, int] = {}
    oom = parse_memory_stat(_read_optional(cgroup_dir / V1_OOM_CONTROL) or "")
    for key in ("oom_kill", "under_oom"):  # oom_kill is printed since Linux 4.13
        if key in oom:
            events[key] = oom[key]
    failures = _parse_int_file(failcnt, _read_optional(failcnt))
    if failures is not None:
        events["failcnt"] = failures
    # total_* are hierarchical (include children); plain keys are this cgroup only.
    inactive = stat.get("total_inactive_file", stat.get("inactive_file"))
    return CgroupMemory(
        version=1,
        path=cgroup_dir,
        usage_bytes=_parse_int_file(usage, _read_optional(usage)),
        inactive_file_bytes=inactive,
        high_bytes=None,
        max_bytes=_parse_limit_file(limit, _read_optional(limit), 1),
        events=events,
        stat=stat,
    )


# ---------------------------------------------------------------- paths


def controller_dirs(root: Path = ROOT, pid: int | str = "self") -> dict[str, Path]:
    """controller -> cgroup directory of ``pid``: one per v1 controller, ``"unified"`` for v2.

    Empty when ``/proc/<pid>/cgroup`` does not exist; without mountinfo the
    usual mount points (/sys/fs/cgroup, /sys/fs/cgroup/<controller>) are
    assumed. The directories need not exist (a controller can be listed for a
    hierarchy that is not mounted). Raises HostReadError for an unreadable file.
    """
    proc = root / "proc" / str(pid)
    cgroup_text = _read_optional(proc / PROC_CGROUP)
    if cgroup_text is None:
        return {}
    mounts = parse_mountinfo_cgroups(_read_optional(proc / PROC_MOUNTINFO) or "")
    out: dict[str, Path] = {}
    for m in parse_proc_cgroup(cgroup_text):
        if m.hierarchy_id == 0:
            v2 = next((x for x in mounts if x.fstype == "cgroup2"), None)
            v2 = v2 or CgroupMount("cgroup2", "/" + DEFAULT_V2_MOUNT, "/", ())
            out["unified"] = root / _join_cgroup_path(v2, m.path).lstrip("/")
            continue
        for ctrl in m.controllers:
            v1 = next((x for x in mounts if x.fstype == "cgroup" and ctrl in x.options), None)
            v1 = v1 or CgroupMount("cgroup", f"/sys/fs/cgroup/{ctrl}", "/", (ctrl,))
            out[ctrl] = root / _join_cgroup_path(v1, m.path).lstrip("/")
    return out


def is_cgroup_dir(path: Path) -> bool:
    """Whether ``path`` is a cgroup directory (it lists its processes)."""
    return (path / PROCS).exists()


def read_procs(cgroup_dir: Path) -> list[int]:
    """The processes in the cgroup (``cgroup.procs``); [] when it is gone or unreadable."""
    text = files.read(cgroup_dir / PROCS).text
    if text is None:
        return []
    return [int(x) for x in text.split() if x.isdigit()]


def kernel_path(cgroup_dir: Path) -> str | None:
    """The cgroup's path as the kernel prints it (``oom_memcg=``), from its directory.

    The hierarchy root is the highest ancestor that still has ``cgroup.procs``
    (above it is the tmpfs or sysfs the hierarchy is mounted on). None when
    ``cgroup_dir`` is not a cgroup.
    """
    if not is_cgroup_dir(cgroup_dir):
        return None
    top = cgroup_dir
    while top.parent != top and is_cgroup_dir(top.parent):
        top = top.parent
    rel = cgroup_dir.relative_to(top).as_posix()
    return "/" if rel == "." else "/" + rel


def unit_cgroup_dir(root: Path, unit: str) -> Path | None:
    """The memory cgroup directory systemd gives ``unit``, or None when it is not running.

    Looks in system.slice first, then in any slice one or two levels down (the
    rendered server unit runs in ``slmguard.slice``), under the v2 mount and
    then the v1 memory hierarchy.
    """
    for base in (root / DEFAULT_V2_MOUNT, root / DEFAULT_V1_MEMORY_MOUNT):
        candidates = [base / "system.slice" / unit]
        candidates += sorted(base.glob(f"*.slice/{unit}"))
        candidates += sorted(base.glob(f"*.slice/*.slice/{unit}"))
        for candidate in candidates:
            if is_cgroup_dir(candidate) and (
                (candidate / V2_CURRENT).exists() or (candidate / V1_USAGE).exists()
            ):
                return candidate
    return None


# ---------------------------------------------------------------- layout


@dataclass(frozen=True)
class CgroupLayout:
    """How cgroups are mounted: which controllers live on v2 and which on v1."""

    v2_mount: str | None  # mount point of the cgroup2 hierarchy, if mounted
    v2_controllers: tuple[str, ...]  # available at the v2 root (cgroup.controllers)
    v2_subtree_control: tuple[str, ...]  # enabled for children of the v2 root
    v1_controllers: tuple[str, ...]  # controllers mounted as v1 hierarchies
    memory_version: int | None

    @property
    def mode(self) -> str:
        """``unified`` (v2 only), ``hybrid`` (both), ``legacy`` (v1 only) or ``none``."""
        has_v1 = bool([c for c in self.v1_controllers if not c.startswith("name=")])
        if self.v2_mount and not has_v1:
            return "unified"
        if self.v2_mount and has_v1:
            return "hybrid"
        return "legacy" if has_v1 else "none"


V1_CONTROLLERS = frozenset(
    {"cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "net_cls", "net_prio",
     "blkio", "perf_event", "hugetlb", "pids", "rdma", "misc"}
)  # fmt: skip


def layout_from(
    mounts: list[CgroupMount],
    v2_controllers: str | None,
    v2_subtree: str | None,
    memory_version: int | None,
) -> CgroupLayout:
    """Pure: combine parsed mountinfo and the v2 root's controller files."""
    v1: list[str] = []
    for m in mounts:
        if m.fstype == "cgroup":
            v1.extend(o for o in m.options if o in V1_CONTROLLERS or o.startswith("name="))
    mount2 = next((m for m in mounts if m.fstype == "cgroup2"), None)
    return CgroupLayout(
        v2_mount=mount2.mount_point if mount2 else None,
        v2_controllers=tuple((v2_controllers or "").split()),
        v2_subtree_control=tuple((v2_subtree or "").split()),
        v1_controllers=tuple(dict.fromkeys(v1)),
        memory_version=memory_version,
    )


def read_layout(root: Path = ROOT) -> CgroupLayout:
    """The cgroup layout seen by this process (root/proc/self/mountinfo)."""
    mountinfo = files.read(root / "proc/self" / PROC_MOUNTINFO).require()
    mounts = parse_mountinfo_cgroups(mountinfo)
    v2_dir = root / _v2_mount_point(mounts).lstrip("/")
    has_v2 = any(m.fstype == "cgroup2" for m in mounts)
    controllers = _read_optional(v2_dir / V2_CONTROLLERS) if has_v2 else None
    subtree = _read_optional(v2_dir / V2_SUBTREE_CONTROL) if has_v2 else None
    return layout_from(mounts, controllers, subtree, memory_cgroup_version(root))
