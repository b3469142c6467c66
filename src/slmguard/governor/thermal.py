"""Heat as a governor input: pure rules that lower the work admitted as the board nears its limit.

Owns the heat levels and their hysteresis, what each level admits (concurrent slots,
the ``max_tokens`` cap, shedding new work) and the steps between them. It reads no file
and sleeps never: :mod:`slmguard.governor.heat` samples the zones and the firmware's
flags into a :class:`HeatSample`, the runtime feeds it to :func:`decide_heat` and carries
out the :class:`HeatStep` values (the slots through the server's ``EngineControl``).

A zone's *room* is its limit (its first passive trip point, else its first ``hot`` one:
where the kernel starts slowing the CPU) minus its temperature; the smallest room of the
watched zones decides. Levels, with the default margins::

    cool   room > 10 °C                   every planned slot
    warm   room <= 10 °C, or ARM capped   half the planned slots (at least one)
    hot    room <= 5 °C, or soft limit    one slot, max_tokens capped
    limit  room <= 0 °C, or throttled     + new work shed (503 thermal_shedding)

(the firmware's flags are a Raspberry Pi's ``get_throttled``, now). Work is lowered in
that order, new work shed last; running generations are never cut and a request that
was admitted finishes. Rising is immediate (straight to the level called for); falling
is one level at a time, once the room stayed ``hysteresis_c`` beyond that level's line
(and the firmware's flag cleared) for ``hold_s``. A sample with nothing readable changes
nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import IntEnum

from slmguard.errors import ConfigError
from slmguard.governor.policy import Admission
from slmguard.host.pithrottle import CAPPED, SOFT_TEMP_LIMIT, THROTTLED, ThrottleFlags


class HeatLevel(IntEnum):
    COOL = 0
    WARM = 1
    HOT = 2
    LIMIT = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class HeatSettings:
    """When heat levels change and what the hot ones do.

    Example::

        HeatSettings(warm_margin_c=8.0, hold_s=60.0)
    """

    warm_margin_c: float = 10.0
    hot_margin_c: float = 5.0
    hysteresis_c: float = 3.0
    hold_s: float = 30.0
    max_tokens_cap: int = 128
    interval_s: float = 1.0  # how often the zones are read
    enabled: bool = True

    def __post_init__(self) -> None:
        values = (self.warm_margin_c, self.hot_margin_c, self.hysteresis_c, self.hold_s)
        if not all(math.isfinite(v) for v in (*values, self.interval_s)):
            raise ConfigError("governor heat settings: every value must be a finite number")
        if not 0 <= self.hot_margin_c < self.warm_margin_c or self.hysteresis_c < 0:
            raise ConfigError(
                "governor heat settings: need 0 <= hot_margin_c < warm_margin_c and "
                f"hysteresis_c >= 0 (got {self.hot_margin_c}, {self.warm_margin_c}, "
                f"{self.hysteresis_c})"
            )
        if self.hold_s < 0 or self.max_tokens_cap < 1 or self.interval_s <= 0:
            raise ConfigError(
                "governor heat settings: hold_s >= 0, max_tokens_cap >= 1, interval_s > 0"
            )

    def line_c(self, level: HeatLevel) -> float:
        """The room at or below which ``level`` starts."""
        return {
            HeatLevel.COOL: math.inf,
            HeatLevel.WARM: self.warm_margin_c,
            HeatLevel.HOT: self.hot_margin_c,
            HeatLevel.LIMIT: 0.0,
        }[level]

    def as_dict(self) -> dict[str, float | int | bool]:
        return {
            "warm_margin_c": self.warm_margin_c,
            "hot_margin_c": self.hot_margin_c,
            "hysteresis_c": self.hysteresis_c,
            "hold_s": self.hold_s,
            "max_tokens_cap": self.max_tokens_cap,
            "interval_s": self.interval_s,
            "enabled": self.enabled,
        }


@dataclass(frozen=True)
class ZoneHeat:
    """One watched zone now. ``temp_c`` None: unreadable, ``error`` says why."""

    name: str  # thermal_zoneN
    type: str
    limit_c: float
    temp_c: float | None = None
    error: str | None = None

    @property
    def room_c(self) -> float | None:
        return None if self.temp_c is None else self.limit_c - self.temp_c


@dataclass(frozen=True)
class HeatSample:
    zones: tuple[ZoneHeat, ...] = ()
    firmware: ThrottleFlags | None = None  # a Raspberry Pi's flags
    taken_s: float = 0.0

    @property
    def readable(self) -> bool:
        return self.firmware is not None or any(z.temp_c is not None for z in self.zones)

    @property
    def hottest(self) -> ZoneHeat | None:
        """The readable zone with the least room."""
        read = [z for z in self.zones if z.room_c is not None]
        return min(read, key=lambda z: z.room_c or 0.0) if read else None


@dataclass(frozen=True)
class HeatState:
    level: HeatLevel = HeatLevel.COOL
    since_s: float = 0.0
    calm_since_s: float | None = None  # beyond the level's line + hysteresis since


@dataclass(frozen=True)
class HeatStep:
    """One change of level, with the temperature that caused it."""

    from_level: HeatLevel
    to_level: HeatLevel
    reason: str  # "rising" | "cooled"
    zone: str | None = None  # the hottest zone's type
    temp_c: float | None = None
    limit_c: float | None = None
    firmware: str | None = None  # the Pi flags now, when they count
    slots: int = 1
    max_tokens_cap: int | None = None


# ---------------------------------------------------------------- rules


def _firmware_level(flags: ThrottleFlags | None) -> HeatLevel:
    if flags is None:
        return HeatLevel.COOL
    if flags.now(THROTTLED):
        return HeatLevel.LIMIT
    if flags.now(SOFT_TEMP_LIMIT):
        return HeatLevel.HOT
    if flags.now(CAPPED):
        return HeatLevel.WARM
    return HeatLevel.COOL


def level_for(sample: HeatSample, settings: HeatSettings, *, extra_c: float = 0.0) -> HeatLevel:
    """The level the sample calls for: the zone with the least room (a room within a
    level's line plus ``extra_c``, the hysteresis when asking whether it cooled enough),
    or the firmware's flags, whichever is higher."""
    level = _firmware_level(sample.firmware)
    hottest = sample.hottest
    room = hottest.room_c if hottest is not None else None
    if room is None:
        return level
    for candidate in (HeatLevel.LIMIT, HeatLevel.HOT, HeatLevel.WARM):
        if room <= settings.line_c(candidate) + extra_c:
            return max(level, candidate)
    return level


def decide_heat(
    state: HeatState, sample: HeatSample, now_s: float, settings: HeatSettings, planned_slots: int
) -> tuple[HeatState, tuple[HeatStep, ...]]:
    """One heat step: the new state and the level changes (at most one)."""
    if not settings.enabled or not sample.readable:
        return state, ()
    called = level_for(sample, settings)
    if called > state.level:
        new = HeatState(called, now_s, None)
        return new, (_step(state.level, called, "rising", sample, settings, planned_slots),)
    if state.level == HeatLevel.COOL:
        return replace(state, calm_since_s=None), ()
    if level_for(sample, settings, extra_c=settings.hysteresis_c) >= state.level:
        return replace(state, calm_since_s=None), ()
    calm = state.calm_since_s if state.calm_since_s is not None else now_s
    if now_s - calm < settings.hold_s:
        return replace(state, calm_since_s=calm), ()
    lower = HeatLevel(state.level - 1)
    new = HeatState(lower, now_s, now_s)  # the next step down waits a full hold again
    return new, (_step(state.level, lower, "cooled", sample, settings, planned_slots),)


def _step(
    old: HeatLevel,
    new: HeatLevel,
    reason: str,
    sample: HeatSample,
    settings: HeatSettings,
    planned_slots: int,
) -> HeatStep:
    hottest = sample.hottest
    flags = sample.firmware
    return HeatStep(
        from_level=old,
        to_level=new,
        reason=reason,
        zone=hottest.type if hottest is not None else None,
        temp_c=hottest.temp_c if hottest is not None else None,
        limit_c=hottest.limit_c if hottest is not None else None,
        firmware=flags.describe() if flags is not None and flags.active else None,
        slots=slots_allowed(new, planned_slots),
        max_tokens_cap=max_tokens_cap(new, settings),
    )


def slots_allowed(level: HeatLevel, planned: int) -> int:
    """Concurrent slots admitted at ``level``: never below one."""
    planned = max(1, planned)
    if level == HeatLevel.COOL:
        return planned
    if level == HeatLevel.WARM:
        return max(1, planned // 2)
    return 1


def max_tokens_cap(level: HeatLevel, settings: HeatSettings) -> int | None:
    return settings.max_tokens_cap if level >= HeatLevel.HOT else None


def admission(level: HeatLevel, settings: HeatSettings) -> Admission | None:
    """503 ``thermal_shedding`` at the limit (new work only); None below it."""
    if level < HeatLevel.LIMIT:
        return None
    return Admission(
        503,
        "thermal_shedding",
        "the board is at its thermal limit: new requests are refused until it cools",
        retry_after_s=max(1, math.ceil(settings.hold_s)),
    )
