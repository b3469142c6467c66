"""The governor's heat side at run time: read the watched zones, step, say so.

Owns :class:`HeatSignal` (the I/O edge: under a root, the thermal zones the plan names,
else every zone with a passive or hot trip point, chosen once by
:func:`slmguard.host.thermal.select_zones`, then only their ``temp`` read at each
sample; and the Raspberry Pi firmware's throttle flags) and :class:`Heat` (the heat
state between samples, read at most every ``interval_s``: each step logged as a
``governor.heat`` event with the temperature, counted, kept for the status route, and
the slots, ``max_tokens`` cap and admission of the level in force). The rules are
:mod:`slmguard.governor.thermal`'s; carrying out the slots is the runtime's (through the
server's ``EngineControl``). No zone and no flags: no heat input, nothing ever steps.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slmguard.governor import events
from slmguard.governor.events import GovernorCounters
from slmguard.governor.policy import Admission
from slmguard.governor.thermal import (
    HeatLevel,
    HeatSample,
    HeatSettings,
    HeatState,
    HeatStep,
    ZoneHeat,
    admission,
    decide_heat,
    max_tokens_cap,
    slots_allowed,
)
from slmguard.host import pithrottle, thermal
from slmguard.host.files import ROOT

#: How often the zones are looked up again (a zone driver bound late, a module reloaded).
RESOLVE_EVERY_S = 60.0


class HeatSignal:
    """The watched zones and the firmware's flags under ``root`` (tests give a tree)."""

    def __init__(
        self,
        root: Path = ROOT,
        zones: tuple[str, ...] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.names = zones
        self.clock = clock
        self.missing: tuple[str, ...] = ()
        self._zones: tuple[tuple[Path, str, float], ...] = ()  # (dir, type, limit)
        self._resolved_s: float | None = None

    def _resolve(self, now: float) -> None:
        found = thermal.read_thermal_zones(self.root)
        chosen, self.missing = thermal.select_zones(found, self.names)
        base = self.root / thermal.THERMAL_DIR
        self._zones = tuple(
            (base / z.name, z.type, z.limit_c) for z in chosen if z.limit_c is not None
        )
        self._resolved_s = now

    def sample(self) -> HeatSample:
        now = self.clock()
        if self._resolved_s is None or now - self._resolved_s >= RESOLVE_EVERY_S:
            self._resolve(now)
        zones = []
        for path, kind, limit in self._zones:
            temp, error = thermal.read_zone_temp(path)
            zones.append(ZoneHeat(path.name, kind, limit, temp, error))
        flags = pithrottle.read_throttle_flags(self.root)
        firmware = flags if isinstance(flags, pithrottle.ThrottleFlags) else None
        return HeatSample(tuple(zones), firmware, now)


class Heat:
    """The heat state of one governor (see the module docstring)."""

    def __init__(
        self,
        signal: HeatSignal,
        settings: HeatSettings,
        *,
        planned_slots: Callable[[], int],
        counters: GovernorCounters,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.signal = signal
        self.settings = settings
        self.planned_slots = planned_slots
        self.counters = counters
        self.clock = clock
        self.state = HeatState(since_s=clock())
        self.sample: HeatSample | None = None
        self.steps: collections.deque[dict[str, Any]] = collections.deque(maxlen=32)
        self.error: str | None = None

    def tick(self) -> tuple[HeatStep, ...]:
        """Sample when the interval is up and step; the steps taken (at most one)."""
        now = self.clock()
        if not self.settings.enabled:
            return ()
        if self.sample is not None and now - self.sample.taken_s < self.settings.interval_s:
            return ()
        try:
            self.sample = self.signal.sample()
            self.error = None
        except OSError as err:  # a reader's last guard: the heat input is lost, not the loop
            self.error = str(err)
            return ()
        self.state, steps = decide_heat(
            self.state, self.sample, now, self.settings, self.planned_slots()
        )
        for step in steps:
            self._record(step)
        return steps

    def _record(self, step: HeatStep) -> None:
        if step.to_level > step.from_level:
            self.counters.degrade(f"heat_{step.to_level.label}")
        fields = {
            "from_level": step.from_level.label,
            "to_level": step.to_level.label,
            "reason": step.reason,
            "zone": step.zone,
            "temp_c": None if step.temp_c is None else round(step.temp_c, 2),
            "limit_c": step.limit_c,
            "firmware": step.firmware,
            "slots": step.slots,
            "max_tokens_cap": step.max_tokens_cap,
            "shedding": step.to_level >= HeatLevel.LIMIT,
        }
        self.steps.append({**fields, "at_unix_s": round(time.time(), 3)})
        events.emit(
            "governor.heat",
            logging.WARNING if step.to_level > step.from_level else logging.INFO,
            **fields,
        )

    @property
    def level(self) -> HeatLevel:
        return self.state.level

    def slots(self) -> int:
        return slots_allowed(self.state.level, self.planned_slots())

    def max_tokens_cap(self) -> int | None:
        return max_tokens_cap(self.state.level, self.settings)

    def admission(self) -> Admission | None:
        return admission(self.state.level, self.settings)

    def status(self) -> dict[str, Any]:
        """The ``thermal`` part of ``GET /api/v1/governor``."""
        sample = self.sample
        flags = sample.firmware if sample is not None else None
        return {
            "enabled": self.settings.enabled,
            "level": self.state.level.label,
            "level_for_s": round(self.clock() - self.state.since_s, 3),
            "slots": self.slots(),
            "planned_slots": self.planned_slots(),
            "max_tokens_cap": self.max_tokens_cap(),
            "shedding": self.state.level >= HeatLevel.LIMIT,
            "zones": [
                {
                    "zone": z.name,
                    "type": z.type,
                    "temp_c": z.temp_c,
                    "limit_c": z.limit_c,
                    "room_c": None if z.room_c is None else round(z.room_c, 2),
                    "error": z.error,
                }
                for z in (sample.zones if sample is not None else ())
            ],
            "zones_missing": list(self.signal.missing),
            "firmware": None if flags is None else flags.describe(),
            "settings": self.settings.as_dict(),
            "steps": list(self.steps),
            "error": self.error,
        }
