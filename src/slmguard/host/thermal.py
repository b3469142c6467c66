"""Temperatures and cooling: is the board throttling the engine?

Owns ``/sys/class/thermal``: thermal zones (``type``, ``temp`` in millidegrees Celsius,
``mode``, ``trip_point_K_temp``/``_type``/``_hyst``; Documentation/driver-api/thermal/sysfs-api.rst)
and cooling devices (``type``, ``cur_state``, ``max_state``), and the decision which
cores are throttled (:func:`throttled_cpus`, :func:`throttle_rises`) from them and the
cores' clocks, which :mod:`slmguard.host.cpu` reads. A temperature that cannot be read
says why (``needs root``, ``No data available`` from a sensor that is off), never 0. A
``scaling_max_freq`` below the hardware maximum is a cap, not a throttle: an
administrator may set it. Pure parsers and decisions apart from the readers; no writes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from slmguard.host import files
from slmguard.host.cpu import CpuFreq
from slmguard.host.files import ROOT

THERMAL_DIR = "sys/class/thermal"

#: Bounds on what a hostile tree can make us read.
MAX_ZONES = 64
MAX_TRIPS = 16
MAX_COOLING = 128


@dataclass(frozen=True)
class TripPoint:
    temp_c: float
    kind: str  # active | passive | hot | critical (as the kernel names it)
    hyst_c: float | None = None  # trip_point_K_hyst: how far below it the kernel lets go


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
    def limit_c(self) -> float | None:
        """Where the kernel starts slowing the board down: the first passive trip, else
        the first ``hot`` trip (a zone with only active and critical trips, the Pi 5's,
        has none: its firmware throttles on its own, see :mod:`slmguard.host.pithrottle`)."""
        p = self.passive_c
        if p is not None:
            return p
        temps = [t.temp_c for t in self.trips if t.kind == "hot"]
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
    """The cores a cpufreq cooling device is slowing down now (a state above 0).

    Those devices are named ``cpufreq-cpuN`` since Linux 5.x (N: the policy's first CPU;
    RK3588 has cpufreq-cpu0/4/6, Jetson Orin cpufreq-cpu0) and ``thermal-cpufreq-K``
    before (K counts registrations, in policy order).
    """
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


def hot_zones(zones: Iterable[ThermalZone]) -> tuple[str, ...]:
    return tuple(z.type for z in zones if z.hot)


def select_zones(
    zones: Iterable[ThermalZone], names: Iterable[str] = ()
) -> tuple[tuple[ThermalZone, ...], tuple[str, ...]]:
    """The zones to watch and the names that matched none: those ``names`` give (a zone's
    ``type`` or its ``thermal_zoneN``), else every zone with a limit
    (:attr:`ThermalZone.limit_c`)."""
    zones = tuple(zones)
    wanted = tuple(names)
    if not wanted:
        return tuple(z for z in zones if z.limit_c is not None), ()
    chosen = tuple(z for z in zones if z.type in wanted or z.name in wanted)
    missing = tuple(n for n in wanted if not any(n in (z.type, z.name) for z in zones))
    return chosen, missing


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
    kind = files.read_attr(path / "type")
    temp = files.read_attr(path / "temp")
    mode = files.read_attr(path / "mode")
    trips: list[TripPoint] = []
    for k in range(MAX_TRIPS):
        t = files.read_attr(path / f"trip_point_{k}_temp")
        if t.absent:
            break
        value = parse_millicelsius(t.text) if t.text is not None else None
        trip_type = files.read_attr(path / f"trip_point_{k}_type").text
        hyst = files.read_attr(path / f"trip_point_{k}_hyst").text
        if value is not None and trip_type:
            hyst_c = parse_millicelsius(hyst) if hyst is not None else None
            trips.append(TripPoint(value, trip_type.strip()[:16], hyst_c))
    temp_c = parse_millicelsius(temp.text) if temp.text is not None else None
    error = temp.error
    if error is None and temp.text is not None and temp_c is None:
        error = f"not a temperature: {temp.text.strip()[:20]!r}"
    if temp.absent:
        error = "no temp file"
    return ThermalZone(
        name=path.name,
        type=(kind.text or "").strip() or path.name,
        temp_c=temp_c,
        enabled=None if mode.text is None else mode.text.strip() == "enabled",
        trips=tuple(trips),
        error=error,
    )


def zone_dirs(root: Path = ROOT) -> tuple[Path, ...]:
    """The ``thermal_zoneN`` directories, in number order (at most :data:`MAX_ZONES`)."""
    return tuple(_numbered(root / THERMAL_DIR, "thermal_zone", MAX_ZONES))


def read_thermal_zones(root: Path = ROOT) -> tuple[ThermalZone, ...]:
    """Every thermal zone (an empty tuple on a VM or a kernel without thermal)."""
    return tuple(read_zone(p) for p in zone_dirs(root))


def read_zone_temp(path: Path) -> tuple[float | None, str | None]:
    """One zone's ``temp`` alone (the governor's per-sample read): (degrees, None) or
    (None, why not)."""
    temp = files.read_attr(path / "temp")
    if temp.text is None:
        return None, "no temp file" if temp.absent else temp.error
    value = parse_millicelsius(temp.text)
    if value is None:
        return None, f"not a temperature: {temp.text.strip()[:20]!r}"
    return value, None


def read_cooling_devices(root: Path = ROOT) -> tuple[CoolingDevice, ...]:
    out = []
    for p in _numbered(root / THERMAL_DIR, "cooling_device", MAX_COOLING):
        out.append(
            CoolingDevice(
                name=p.name,
                type=(files.read_attr(p / "type").text or "").strip(),
                cur_state=files.read_attr(p / "cur_state").integer(),
                max_state=files.read_attr(p / "max_state").integer(),
            )
        )
    return tuple(out)


def throttle_rises(before: Mapping[int, int | None], after: Iterable[CpuFreq]) -> frozenset[int]:
    """x86: cores whose ``core_throttle_count`` rose between two reads (a throttle the
    cooling devices do not show)."""
    out = set()
    for f in after:
        prev = before.get(f.cpu)
        if prev is not None and f.throttle_count is not None and f.throttle_count > prev:
            out.add(f.cpu)
    return frozenset(out)
