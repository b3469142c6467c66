"""The board's own state, read once: clocks, governors, power mode, heat and throttle flags.

Owns :func:`read_board_state`, one call of every board-tuning reader under a root
(the cores' cpufreq, every devfreq device, thermal zones with their trip points,
cooling devices and the cores they slow, the Jetson power mode, the Pi firmware's
throttle flags, the device tree's identity, the load averages) into a frozen
:class:`BoardState`, and :meth:`BoardState.as_dict`, the plain JSON form the bench
records before and after a run and ``top`` shows. A reader that fails leaves its
field empty and a line in ``errors``; nothing raises for the host. What the state
means for a plan is :mod:`slmguard.tuning`'s; the doctor's snapshot carries it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from slmguard.errors import HostReadError
from slmguard.host import devfreq, nvpmodel, pithrottle, procfs, thermal
from slmguard.host.cpu import CpuFreq, read_cpu_facts, read_cpufreq
from slmguard.host.devfreq import Devfreq
from slmguard.host.files import ROOT

T = TypeVar("T")


@dataclass(frozen=True)
class BoardState:
    """Everything about the board's tuning that a run's speed depends on, at one moment."""

    root: str
    taken_unix_s: float
    model: str | None = None  # the device tree's model
    compatible: tuple[str, ...] = ()  # the device tree's compatible strings
    online: tuple[int, ...] = ()
    big_cores: tuple[int, ...] = ()  # the fastest cores (all online ones when uniform)
    cpufreq: tuple[CpuFreq, ...] = ()
    devfreq: tuple[Devfreq, ...] = ()
    zones: tuple[thermal.ThermalZone, ...] = ()
    cooling: tuple[thermal.CoolingDevice, ...] = ()
    throttled_cpus: tuple[int, ...] = ()  # slowed by a cpufreq cooling device now
    power_modes: nvpmodel.PowerModes | None = None  # None: not a Jetson
    pi_flags: pithrottle.ThrottleFlags | None = None  # None: not a Pi (or unreadable)
    loadavg: tuple[float, float, float] | None = None
    errors: tuple[str, ...] = field(default_factory=tuple)  # "path: why" per failed read

    def is_soc(self, prefix: str) -> bool:
        """Whether a device tree compatible string starts with ``prefix`` (``rockchip,rk3588``)."""
        return any(c.startswith(prefix) for c in self.compatible)

    def freq(self, cpu: int) -> CpuFreq | None:
        return next((f for f in self.cpufreq if f.cpu == cpu), None)

    def zone(self, kind: str) -> thermal.ThermalZone | None:
        """The zone of that ``type`` (``bigcore0-thermal``), or of that directory name."""
        return next((z for z in self.zones if kind in (z.type, z.name)), None)

    @property
    def memory_devfreq(self) -> tuple[Devfreq, ...]:
        return tuple(d for d in self.devfreq if d.kind == "memory")

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON: every field, the derived ones a reader needs spelt out."""
        out: dict[str, Any] = _plain(self)
        out["pi_flags"] = (
            None
            if self.pi_flags is None
            else {
                **_plain(self.pi_flags),
                "hex": f"{self.pi_flags.value:#x}",
                "now": list(self.pi_flags.active),
                "since_boot": list(self.pi_flags.occurred),
            }
        )
        out["power_mode"] = _power_mode(self.power_modes)
        return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _power_mode(modes: nvpmodel.PowerModes | None) -> dict[str, Any] | None:
    if modes is None:
        return None
    active = modes.active
    return {
        "id": modes.active_id,
        "name": active.name if active is not None else None,
        "set_since_flashing": modes.current_id is not None,
    }


class _Reads:
    """Runs each reader, keeping what failed as a line instead of raising."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.errors: list[str] = []

    def run(self, what: str, fn: Callable[[], T], default: T) -> T:
        try:
            return fn()
        except HostReadError as err:
            self.errors.append(f"{err.path}: {err.problem}")
        except (OSError, ValueError, UnicodeDecodeError) as err:
            self.errors.append(f"{self.root / what}: {type(err).__name__}: {err}")
        return default


def read_board_state(root: Path = ROOT, *, clock: Callable[[], float] = time.time) -> BoardState:
    """Every board-tuning fact under ``root`` (see the module docstring)."""
    r = _Reads(root)
    facts = r.run("sys/devices/system/cpu", lambda: read_cpu_facts(root), None)
    online = facts.online if facts is not None else ()
    big = facts.big_cores if facts is not None else ()
    no_freqs: tuple[CpuFreq, ...] = ()
    no_cooling: tuple[thermal.CoolingDevice, ...] = ()
    freqs = r.run("sys/devices/system/cpu", lambda: read_cpufreq(root, online), no_freqs)
    cooling = r.run(thermal.THERMAL_DIR, lambda: thermal.read_cooling_devices(root), no_cooling)
    flags = r.run("sys", lambda: pithrottle.read_throttle_flags(root), None)
    if isinstance(flags, str):
        r.errors.append(flags)
        flags = None
    return BoardState(
        root=str(root),
        taken_unix_s=clock(),
        model=r.run("proc/device-tree/model", lambda: procfs.read_device_tree_model(root), None),
        compatible=r.run(
            "proc/device-tree/compatible",
            lambda: procfs.read_device_tree_strings(root, "compatible"),
            (),
        ),
        online=online,
        big_cores=big,
        cpufreq=freqs,
        devfreq=r.run(devfreq.DEVFREQ_DIR, lambda: devfreq.read_devfreq(root), ()),
        zones=r.run(thermal.THERMAL_DIR, lambda: thermal.read_thermal_zones(root), ()),
        cooling=cooling,
        throttled_cpus=tuple(sorted(thermal.throttled_cpus(freqs, cooling))),
        power_modes=r.run(nvpmodel.CONF, lambda: nvpmodel.read_power_modes(root), None),
        pi_flags=flags,
        loadavg=r.run("proc/loadavg", lambda: procfs.read_loadavg(root), None),
        errors=tuple(r.errors),
    )
