"""systemd unit files: parse them (with drop-ins) and, on a live host, ask systemd.

Owns a unit-file parser following systemd.syntax(7) (``[Section]``, ``Key=Value``,
``#``/``;`` comments, backslash continuation, an empty assignment resetting a list) with
its drop-ins (``<unit>.d/*.conf`` from every unit directory, after the main file in name
order, a file in /etc hiding a same-named one in /usr); which section each key belongs
in; value parsers (sizes, time spans, CPU sets, ExecStart= argv, Environment=); whether
a unit is installed, enabled or masked, read from the files so it works on a board image;
``systemctl show`` (only when systemd is PID 1 and the root is ``/``); and parsers of what
``systemd-analyze`` prints (ignored keys, the exposure score), so the tests and benchmarks
that run it read it one way. It never writes unit files (render and apply do).
"""

from __future__ import annotations

import logging
import re
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import files
from slmguard.host.files import ROOT

log = logging.getLogger(__name__)

UNIT_DIRS = (
    "etc/systemd/system",
    "run/systemd/system",
    "usr/local/lib/systemd/system",
    "usr/lib/systemd/system",
    "lib/systemd/system",
)

# Keys systemd reads only in [Unit] (systemd.unit(5)). StartLimitIntervalSec= is parsed
# only there (since v230) and ignored in [Service] with a warning nobody reads; the old
# StartLimitInterval=, StartLimitBurst= and StartLimitAction= are still accepted in
# [Service] (SERVICE_COMPAT_KEYS). Resource-control and exec keys (MemoryMax=,
# CPUAffinity=, User=...) are ignored anywhere but [Service] (checked with systemd 252's
# systemd-analyze verify).
UNIT_SECTION_KEYS = frozenset(
    {
        "Description", "Documentation", "Wants", "Requires", "Requisite", "BindsTo",
        "PartOf", "Upholds", "Conflicts", "Before", "After", "OnFailure", "OnSuccess",
        "PropagatesReloadTo", "ReloadPropagatedFrom", "JoinsNamespaceOf",
        "RequiresMountsFor", "DefaultDependencies", "StopWhenUnneeded",
        "RefuseManualStart", "RefuseManualStop", "AllowIsolate", "JobTimeoutSec",
        "StartLimitIntervalSec", "StartLimitInterval", "StartLimitBurst",
        "StartLimitAction", "FailureAction", "SuccessAction", "RebootArgument",
        "ConditionPathExists", "ConditionHost", "ConditionVirtualization",
        "AssertPathExists",
    }
)  # fmt: skip
# [Unit] keys that [Service] still accepts (load-fragment-gperf: compatibility).
SERVICE_COMPAT_KEYS = frozenset(
    {"StartLimitInterval", "StartLimitBurst", "StartLimitAction", "FailureAction",
     "RebootArgument"}
)  # fmt: skip
# Keys systemd reads only in [Service] (systemd.service(5), .exec(5), .kill(5),
# .resource-control(5)); the ones a hardened inference unit uses.
SERVICE_SECTION_KEYS = frozenset(
    {
        "Type", "ExecStart", "ExecStartPre", "ExecStartPost", "ExecReload", "ExecStop",
        "ExecStopPost", "Restart", "RestartSec", "TimeoutStartSec", "TimeoutStopSec",
        "TimeoutSec", "WatchdogSec", "NotifyAccess", "RemainAfterExit", "PIDFile",
        "User", "Group", "DynamicUser", "SupplementaryGroups", "WorkingDirectory",
        "Environment", "EnvironmentFile", "UMask", "Nice", "CPUAffinity",
        "OOMScoreAdjust", "OOMPolicy", "LimitMEMLOCK", "LimitNOFILE", "LimitCORE",
        "MemoryAccounting", "MemoryMin", "MemoryLow", "MemoryHigh", "MemoryMax",
        "MemorySwapMax", "MemoryZSwapMax", "MemoryLimit", "CPUAccounting", "CPUWeight",
        "CPUQuota", "AllowedCPUs", "AllowedMemoryNodes", "TasksMax", "IOWeight",
        "DeviceAllow", "DevicePolicy", "IPAddressAllow", "IPAddressDeny",
        "KillMode", "KillSignal", "SendSIGKILL", "NoNewPrivileges", "ProtectSystem",
        "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateNetwork",
        "ProtectKernelTunables", "ProtectKernelModules", "ProtectControlGroups",
        "CapabilityBoundingSet", "AmbientCapabilities", "ReadWritePaths",
        "StateDirectory", "RuntimeDirectory", "LogsDirectory", "RestrictAddressFamilies",
        "SystemCallFilter", "MemoryDenyWriteExecute", "LockPersonality",
        "RestrictRealtime", "RestrictNamespaces", "ProtectClock", "ProtectHostname",
        "ProtectKernelLogs", "ProtectProc", "ProcSubset", "StandardOutput",
        "StandardError", "SyslogIdentifier", "Slice", "Delegate",
    }
)  # fmt: skip
INSTALL_SECTION_KEYS = frozenset({"WantedBy", "RequiredBy", "Alias", "Also", "DefaultInstance"})

_SECTION_OF: dict[str, str] = {
    **{k: "Unit" for k in UNIT_SECTION_KEYS},
    **{k: "Service" for k in SERVICE_SECTION_KEYS},
    **{k: "Install" for k in INSTALL_SECTION_KEYS},
}


@dataclass(frozen=True)
class UnitEntry:
    section: str
    key: str
    value: str
    path: Path
    lineno: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.lineno}"


@dataclass(frozen=True)
class Misplacement:
    """A key in a section where systemd ignores it (or accepts it only for compatibility)."""

    entry: UnitEntry
    belongs_in: str
    ignored: bool  # True: systemd drops it; False: accepted but deprecated there


@dataclass(frozen=True)
class UnitFile:
    """A parsed unit: the main file then its drop-ins, in the order systemd applies them."""

    name: str
    path: Path
    entries: tuple[UnitEntry, ...]
    dropins: tuple[Path, ...] = ()

    def values(self, section: str, key: str) -> tuple[str, ...]:
        """All values of ``key`` in ``section``; an empty assignment clears earlier ones."""
        out: list[str] = []
        for e in self.entries:
            if e.section == section and e.key == key:
                if e.value == "":
                    out.clear()
                else:
                    out.append(e.value)
        return tuple(out)

    def get(self, section: str, key: str) -> str | None:
        """The effective value of a single-valued key (the last one), or None."""
        vals = self.values(section, key)
        return vals[-1] if vals else None

    def entry(self, section: str, key: str) -> UnitEntry | None:
        """The last entry setting ``key`` in ``section`` (for evidence: file and line)."""
        found = [e for e in self.entries if e.section == section and e.key == key]
        return found[-1] if found else None

    def anywhere(self, key: str) -> tuple[UnitEntry, ...]:
        return tuple(e for e in self.entries if e.key == key)


# ---------------------------------------------------------------- pure parsers


def parse_unit_text(text: str, path: Path) -> tuple[UnitEntry, ...]:
    """Entries of one unit file. Lines before any section header are ignored, as systemd does."""
    entries: list[UnitEntry] = []
    section = ""
    pending = ""
    start = 0
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not pending:
            start = lineno
            if not line or line[0] in "#;":
                continue
        elif line[:1] in ("#", ";"):
            continue  # comment lines inside a continuation are skipped (systemd >= 235)
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            continue
        key, sep, value = line.partition("=")
        if not sep or not section:
            continue
        entries.append(UnitEntry(section, key.strip(), value.strip(), path, start))
    if pending and section:
        key, sep, value = pending.partition("=")
        if sep:
            entries.append(UnitEntry(section, key.strip(), value.strip(), path, start))
    return tuple(entries)


def misplaced_keys(unit: UnitFile) -> tuple[Misplacement, ...]:
    """Keys set in a section other than the one systemd reads them in."""
    out: list[Misplacement] = []
    for e in unit.entries:
        home = _SECTION_OF.get(e.key)
        if home is None or home == e.section or e.section.startswith("X-"):
            continue
        # Resource-control keys are also valid in [Slice], [Scope], [Socket], [Mount]...
        if home == "Service" and e.section not in ("Unit", "Install"):
            continue
        compat = e.section == "Service" and e.key in SERVICE_COMPAT_KEYS
        out.append(Misplacement(e, home, ignored=not compat))
    return tuple(out)


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGTPE]?)$", re.IGNORECASE)
_SIZE_SHIFT = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40, "P": 50, "E": 60}


def parse_size(value: str, ram_bytes: int | None = None) -> int | None:
    """Bytes from a resource-control size: ``2600M``, ``2G``, ``50%``; ``infinity`` -> None.

    Suffixes are base 1024 (systemd.resource-control(5)). A percentage needs
    ``ram_bytes``. Raises ValueError on anything else.
    """
    v = value.strip()
    if v == "infinity":
        return None
    if v.endswith("%"):
        if ram_bytes is None:
            raise ValueError(f"{value!r} is a percentage of RAM, and RAM is unknown")
        return int(float(v[:-1]) / 100 * ram_bytes)
    m = _SIZE.match(v)
    if not m:
        raise ValueError(f"not a size: {value!r}")
    return int(float(m.group(1)) * (1 << _SIZE_SHIFT[m.group(2).upper()]))


_SPAN_UNITS = {
    "us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0,
    "second": 1.0, "seconds": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
    "minutes": 60.0, "h": 3600.0, "hr": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
}  # fmt: skip


def parse_timespan_s(value: str) -> float:
    """Seconds from a systemd time span (``60s``, ``1min 30s``, ``5``: seconds)."""
    v = value.strip()
    if v == "infinity":
        return float("inf")
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", v)
    if not parts or re.sub(r"[\d.\sa-z]", "", v):
        raise ValueError(f"not a time span: {value!r}")
    total = 0.0
    for number, unit in parts:
        if unit not in _SPAN_UNITS and unit != "":
            raise ValueError(f"unknown time unit {unit!r} in {value!r}")
        total += float(number) * _SPAN_UNITS.get(unit, 1.0)
    return total


def parse_cpu_set(value: str) -> tuple[int, ...]:
    """CPU indices from ``4 5 6 7``, ``4-7`` or ``0,2-3``. Raises ValueError."""
    cpus: set[int] = set()
    for item in re.split(r"[\s,]+", value.strip()):
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        if sep:
            cpus.update(range(int(lo), int(hi) + 1))
        else:
            cpus.add(int(lo))
    return tuple(sorted(cpus))


def exec_argv(value: str) -> tuple[str, ...]:
    """argv of an ExecStart= value, without systemd's ``@-:+!`` prefixes."""
    v = value.lstrip("@-:+!")
    try:
        return tuple(shlex.split(v))
    except ValueError:
        return tuple(v.split())


def service_environment(unit: UnitFile) -> dict[str, str]:
    """The variables ``Environment=`` lines in ``[Service]`` set (quoted words, last wins).

    ``EnvironmentFile=`` is not read: the file may live only on the board.
    """
    env: dict[str, str] = {}
    for value in unit.values("Service", "Environment"):
        for item in exec_argv(value):
            key, sep, val = item.partition("=")
            if sep:
                env[key] = val
    return env


def parse_show(text: str) -> dict[str, str]:
    """``systemctl show`` output (``Key=Value`` lines)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key] = value
    return out


def ignored_keys(unit: UnitFile) -> frozenset[str]:
    """Keys of ``unit`` that systemd drops because of the section they stand in."""
    return frozenset(m.entry.key for m in misplaced_keys(unit) if m.ignored)


# systemd 252: "x.service:17: Unknown key 'StartLimitIntervalSec' in section [Service], ignoring."
_UNKNOWN_KEY = re.compile(r"Unknown key '([^']*)'")
# systemd 252: "→ Overall exposure level for x.service: 9.6 UNSAFE 😨"
_EXPOSURE = re.compile(r"Overall exposure level for \S+: (\d+\.\d+)(?: (\S+))?")


def unknown_keys(verify_output: str) -> frozenset[str]:
    """Keys ``systemd-analyze verify`` reports as unknown where they stand (and ignores)."""
    return frozenset(_UNKNOWN_KEY.findall(verify_output))


@dataclass(frozen=True)
class Exposure:
    """``systemd-analyze security``'s overall verdict on a service unit."""

    score: float  # 0.0 locked down .. 10.0 fully exposed
    rating: str  # OK, MEDIUM, EXPOSED, UNSAFE ("" when not printed)

    def __str__(self) -> str:
        return f"{self.score:.1f} {self.rating}".rstrip()


def parse_exposure(security_output: str) -> Exposure | None:
    """The overall exposure in ``systemd-analyze security`` output, or None when absent."""
    m = _EXPOSURE.search(security_output)
    return Exposure(float(m.group(1)), m.group(2) or "") if m else None


# ---------------------------------------------------------------- readers


def _dropin_files(root: Path, name: str) -> tuple[Path, ...]:
    by_name: dict[str, Path] = {}
    for d in reversed(UNIT_DIRS):  # later (higher priority) dirs overwrite same-named files
        folder = root / d / f"{name}.d"
        if folder.is_dir():
            for f in folder.glob("*.conf"):
                by_name[f.name] = f
    return tuple(by_name[k] for k in sorted(by_name))


def find_unit(root: Path, name: str) -> Path | None:
    for d in UNIT_DIRS:
        path = root / d / name
        if path.is_file():
            return path
    return None


def find_unit_file(root: Path, unit: str) -> Path | None:
    """The unit file systemd would load for ``unit`` (first in UNIT_DIRS order).

    Unlike :func:`find_unit`, a symlink counts even when it points nowhere
    (a mask, or a link into a directory absent under ``root``).
    """
    for d in UNIT_DIRS:
        path = root / d / unit
        if path.is_symlink() or path.exists():
            return path
    return None


def unit_masked(root: Path, unit: str) -> bool:
    """Masked: /etc (or /run)/systemd/system/<unit> is a symlink to /dev/null."""
    for d in ("etc/systemd/system", "run/systemd/system"):
        path = root / d / unit
        if path.is_symlink() and str(path.readlink()) == "/dev/null":
            return True
    return False


def unit_enabled_links(root: Path, unit: str) -> tuple[Path, ...]:
    """``*.wants``/``*.requires`` symlinks that pull ``unit`` in at boot (enabled when any).

    Looked for in every unit directory: the admin's in /etc, the vendor's in /lib.
    """
    found: list[Path] = []
    for d in UNIT_DIRS:
        base = root / d
        if not base.is_dir():
            continue
        for pattern in ("*.wants", "*.requires"):
            for wants in sorted(base.glob(pattern)):
                link = wants / unit
                if link.is_symlink() or link.exists():
                    found.append(link)
    return tuple(found)


def load_unit(root: Path, name_or_file: str) -> UnitFile:
    """A unit by name (searched under ``root`` with drop-ins) or by file path (alone).

    Raises HostReadError when it cannot be found or read.
    """
    as_file = Path(name_or_file)
    if "/" in name_or_file or as_file.is_file():
        text = files.read(as_file.resolve()).require()
        return UnitFile(as_file.name, as_file, parse_unit_text(text, as_file))
    name = name_or_file if "." in name_or_file else name_or_file + ".service"
    path = find_unit(root, name)
    if path is None:
        raise HostReadError(root / UNIT_DIRS[0] / name, "unit not installed")
    entries = list(parse_unit_text(files.read(path).require(), path))
    dropins = _dropin_files(root, name)
    for f in dropins:
        entries.extend(parse_unit_text(files.read(f).require(), f))
    return UnitFile(name, path, tuple(entries), dropins)


def systemd_is_pid1(root: Path = ROOT) -> bool:
    """sd_booted(3): /run/systemd/system exists only when systemd is the init system."""
    return (root / "run/systemd/system").is_dir()


SHOW_PROPERTIES = (
    "LoadState", "FragmentPath", "DropInPaths", "MemoryCurrent", "MemoryHigh",
    "MemoryMax", "OOMScoreAdjust", "StartLimitIntervalUSec", "StartLimitBurst",
    "CPUAffinity", "User", "LimitMEMLOCK", "Restart", "ActiveState",
)  # fmt: skip


def show_unit(
    name: str, root: Path = ROOT, properties: Sequence[str] = SHOW_PROPERTIES
) -> dict[str, str] | None:
    """Effective properties from ``systemctl show``; None when not applicable.

    Not applicable: root is not ``/``, systemd is not PID 1, systemctl is
    missing, or the unit is not installed (LoadState=not-found).
    """
    if root.resolve() != Path("/") or not systemd_is_pid1(root):
        return None
    try:
        done = subprocess.run(
            ["systemctl", "show", "--property=" + ",".join(properties), name],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        log.info("systemctl show %s failed: %s", name, err)
        return None
    if done.returncode != 0:
        log.info("systemctl show %s: %s", name, done.stderr.strip())
        return None
    props = parse_show(done.stdout)
    if props.get("LoadState") in (None, "not-found"):
        return None
    return props


#: ``systemctl show``'s figure for "no value" (UINT64_MAX, also "[not set]" as text).
_NO_VALUE = (1 << 64) - 1


def parse_memory_property(value: str | None) -> int | None:
    """Bytes from a ``MemoryCurrent=``/``MemoryPeak=`` value; None when systemd has none
    (``[not set]``, UINT64_MAX: no accounting, not running, or a systemd without it)."""
    if value is None or not re.fullmatch(r"\d{1,20}", value.strip()):
        return None
    n = int(value)
    return None if n >= _NO_VALUE else n


@dataclass(frozen=True)
class UnitMemory:
    """What systemd says a unit's cgroup holds now and held at most (MemoryPeak=, systemd
    >= 255 with cgroup2's memory.peak; None where it has no value)."""

    active_state: str
    current_bytes: int | None
    peak_bytes: int | None


def unit_memory(name: str, root: Path = ROOT) -> UnitMemory | None:
    """A running unit's memory from ``systemctl show``; None where that does not apply
    (:func:`show_unit`). ``name`` must be a validated unit name (never an option)."""
    if name.startswith("-"):
        raise ValueError(f"not a unit name: {name!r}")
    props = show_unit(name, root, ("LoadState", "ActiveState", "MemoryCurrent", "MemoryPeak"))
    if props is None:
        return None
    return UnitMemory(
        active_state=props.get("ActiveState", ""),
        current_bytes=parse_memory_property(props.get("MemoryCurrent")),
        peak_bytes=parse_memory_property(props.get("MemoryPeak")),
    )
