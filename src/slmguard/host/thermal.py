"""Temperatures, cooling and CPU frequencies: is the board throttling the engine?

Owns reading, under a root:

- thermal zones, ``/sys/class/thermal/thermal_zoneN/`` (``type``, ``temp`` in
  millidegrees Celsius, ``mode``, ``trip_point_K_temp`` / ``_type``;
  Documentation/driver-api/thermal/sysfs-api.rst);
- cooling devices, ``/sys/class/thermal/cooling_deviceN/`` (``type``,
  ``cur_state``, ``max_state``);
- cpufreq per core, ``/sys/devices/system/cpu/cpuN/cpufreq/`` (a link to its
  ``policyK``: ``scaling_cur_freq``, ``scaling_max_freq``,
  ``cpuinfo_max_freq`` in kHz, ``scaling_governor``, ``related_cpus``) and
  x86's ``thermal_throttle/core_throttle_count``.

A core is **throttled** when a cpufreq cooling device bound to its policy is
in a state above 0 (the thermal governor is lowering its frequency). Those
devices are named ``cpufreq-cpuN`` since Linux 5.x (N: the policy's first
CPU; RK3588 has cpufreq-cpu0/4/6, Jetson Orin cpufreq-cpu0) and
``thermal-cpufreq-K`` before (K counts registrations, in policy order). On
x86 a rising ``core_throttle_count`` says the same (the collector compares
two reads). A ``scaling_max_freq`` below ``cpuinfo_max_freq`` is shown as a
cap, not a throttle: an administrator may set it on purpose.

A temperature that cannot be read says why (``needs root``, ``No data
available`` from a sensor that is off), never 0. Pure parsers and decisions
are split from the readers; nothing here writes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from slmguard.host.procfs import ROOT
from slmguard.host.sysfs import read_attr
from slmguard.host.systemd import parse_cpu_set

THERMAL_DIR = "sys/class/thermal"
CPU_DIR = "sys/devices/system/cpu"

#: Bounds on what a hostile tree can make us read.
MAX_ZONES = 64
MAX_TRIPS = 16
MAX_COOLING = 128
MAX_CPUS = 4096


@dataclass(frozen=True)
class TripPoint:
    temp_c: float
    kind: str  # active | passive | hot | critical (as the kernel names it)


@dataclass(frozen=True)
class ThermalZone:
    """One thermal zone. ``temp_c`` None: not readable, and ``error`` says why."""

    name: str  # thermal_zoneN
    type: str  # soc-thermal, bigcore0-thermal, CPU-therm, x86_pkg_temp ...
    temp_c: float | None
    enabled: bool | None = None
    trips: tuple[TripPoint, ...] = ()
    error: str | None = None

    @property
    def passive_c(self) -> float | None:
        """The lowest passive trip: where the kernel starts cooling by slowing the CPU."""
        temps = [t.temp_c for t in self.trips if t.kind == "passive"]
        return min(temps) if temps else None

    @property
    def critical_c(self) -> float | None:
        temps = [t.temp_c for t in self.trips if t.kind == "critical"]
        return min(temps) if temps else None

    @property
    def hot(self) -> bool:
        """At or above its first passive trip point."""
        p = self.passive_c
        return self.temp_c is not None and p is not None and self.temp_c >= p


@dataclass(frozen=True)
class CoolingDevice:
    name: str  # cooling_deviceN
    type: str
    cur_state: int | None
    max_state: int | None

    @property
    def active(self) -> bool:
        return bool(self.cur_state)


@dataclass(frozen=True)
class CpuFreq:
    """One core's frequency facts in kHz. ``None`` where the kernel did not say."""

    cpu: int
    cur_khz: int | None
    scaling_max_khz: int | None
    hw_max_khz: int | None  # cpuinfo_max_freq
    governor: str | None = None
    policy_cpus: tuple[int, ...] = ()  # related_cpus: the cores that share this clock
    throttle_count: int | None = None  # x86 thermal_throttle/core_throttle_count
    error: str | None = None

    @property
    def capped(self) -> bool:
        """scaling_max_freq below the hardware maximum (a policy or a user limit)."""
        return (
            self.scaling_max_khz is not None
            and self.hw_max_khz is not None
            and self.scaling_max_khz < self.hw_max_khz
        )


# ---------------------------------------------------------------- pure parsers


def parse_millicelsius(text: str) -> float | None:
    """``"45250\\n"`` -> 45.25 (the sysfs ABI is millidegrees Celsius, may be negative)."""
    try:
        return int(text.strip()) / 1000.0
    except ValueError:
        return None


_COOLING_CPU = re.compile(r"^cpufreq-cpu(\d+)$")
_COOLING_OLD = re.compile(r"^thermal-cpufreq-(\d+)$")


def throttled_cpus(freqs: Iterable[CpuFreq], cooling: Iterable[CoolingDevice]) -> frozenset[int]:
    """The cores a cpufreq cooling device is slowing down now (see the module docstring)."""
    freqs = list(freqs)
    policies: dict[int, tuple[int, ...]] = {}  # first cpu of a policy -> its cpus
    for f in freqs:
        cpus = f.policy_cpus or (f.cpu,)
        policies.setdefault(min(cpus), tuple(sorted(cpus)))
    in_order = [policies[k] for k in sorted(policies)]
    out: set[int] = set()
    for dev in cooling:
        if not dev.active:
            continue
        m = _COOLING_CPU.match(dev.type)
        if m:
            first = int(m.group(1))
            out.update(next((p for p in in_order if first in p), (first,)))
            continue
        m = _COOLING_OLD.match(dev.type)
        if m and int(m.group(1)) < len(in_order):
            out.update(in_order[int(m.group(1))])
    return frozenset(out)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``related_cpus`` (``"0 1 2 3"`` or ``"4-5"``); empty when garbled or out of bounds."""
    numbers = [int(n) for n in re.findall(r"\d+", text)]
    if not numbers or max(numbers) >= MAX_CPUS:
        return ()
    try:
        return parse_cpu_set(text)
    except ValueError:
        return ()


def hot_zones(zones: Iterable[ThermalZone]) -> tuple[str, ...]:
    return tuple(z.type for z in zones if z.hot)


# ---------------------------------------------------------------- readers


def _numbered(directory: Path, prefix: str, limit: int) -> list[Path]:
    try:
        entries = [p for p in directory.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return []
    suffix = len(prefix)
    entries = [p for p in entries if p.name[suffix:].isdigit()]
    return sorted(entries, key=lambda p: int(p.name[suffix:]))[:limit]


def read_zone(path: Path) -> ThermalZone:
    kind = read_attr(path / "type")
    temp = read_attr(path / "temp")
    mode = read_attr(path / "mode")
    trips: list[TripPoint] = []
    for k in range(MAX_TRIPS):
        t = read_attr(path / f"trip_point_{k}_temp")
        if t.missing:
            break
        value = parse_millicelsius(t.text) if t.text is not None else None
        trip_type = read_attr(path / f"trip_point_{k}_type").text
        if value is not None and trip_type:
            trips.append(TripPoint(value, trip_type.strip()))
    temp_c = parse_millicelsius(temp.text) if temp.text is not None else None
    error = temp.error
    if error is None and temp.text is not None and temp_c is None:
        error = f"not a temperature: {temp.text.strip()[:20]!r}"
    if temp.missing:
        error = "no temp file"
    return ThermalZone(
        name=path.name,
        type=(kind.text or "").strip() or path.name,
        temp_c=temp_c,
        enabled=None if mode.text is None else mode.text.strip() == "enabled",
        trips=tuple(trips),
        error=error,
    )


def read_thermal_zones(root: Path = ROOT) -> tuple[ThermalZone, ...]:
    """Every thermal zone (an empty tuple on a VM or a kernel without thermal)."""
    return tuple(read_zone(p) for p in _numbered(root / THERMAL_DIR, "thermal_zone", MAX_ZONES))


def read_cooling_devices(root: Path = ROOT) -> tuple[CoolingDevice, ...]:
    out = []
    for p in _numbered(root / THERMAL_DIR, "cooling_device", MAX_COOLING):
        out.append(
            CoolingDevice(
                name=p.name,
                type=(read_attr(p / "type").text or "").strip(),
                cur_state=read_attr(p / "cur_state").integer(),
                max_state=read_attr(p / "max_state").integer(),
            )
        )
    return tuple(out)


def read_cpufreq(root: Path, cpus: Iterable[int]) -> tuple[CpuFreq, ...]:
    """cpufreq facts of ``cpus``; a core without cpufreq (a VM) has Nones and no error."""
    out = []
    for cpu in cpus:
        base = root / CPU_DIR / f"cpu{cpu}"
        freq = base / "cpufreq"
        cur = read_attr(freq / "scaling_cur_freq")
        policy = parse_cpu_list(read_attr(freq / "related_cpus").text or "")
        governor = read_attr(freq / "scaling_governor").text
        out.append(
            CpuFreq(
                cpu=cpu,
                cur_khz=cur.integer(),
                scaling_max_khz=read_attr(freq / "scaling_max_freq").integer(),
                hw_max_khz=read_attr(freq / "cpuinfo_max_freq").integer(),
                governor=governor.strip() if governor else None,
                policy_cpus=policy,
                throttle_count=read_attr(base / "thermal_throttle/core_throttle_count").integer(),
                error=cur.error,
            )
        )
    return tuple(out)


def throttle_rises(before: Mapping[int, int | None], after: Iterable[CpuFreq]) -> frozenset[int]:
    """x86: cores whose core_throttle_count rose between two reads."""
    out = set()
    for f in after:
        prev = before.get(f.cpu)
        if prev is not None and f.throttle_count is not None and f.throttle_count > prev:
            out.add(f.cpu)
    return frozenset(out)
