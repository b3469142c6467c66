"""Tuning check on heat: the thermal zones the governor watches, their trips and temperature.

Owns ``tuning.thermal``: the zones the plan names (``board.thermal_zones``; without
names, every zone with a passive or ``hot`` trip point, where the kernel starts slowing
the board: :func:`slmguard.host.thermal.select_zones`), each with its temperature now
and its trip points. A zone at or above its limit fails (the kernel throttles now),
within :data:`NEAR_C` of it warns, a zone the plan names that the board lacks warns
(the governor would watch nothing there). Pure: reads only the
:class:`~slmguard.host.boardstate.BoardState`.
"""

from __future__ import annotations

from slmguard.host.boardstate import BoardState
from slmguard.host.thermal import THERMAL_DIR, ThermalZone, select_zones
from slmguard.tuning.notes import Evidence, Note, NoteId, Target

#: A zone this close to its limit is warm enough to say so.
NEAR_C = 10.0


def _c(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f} °C"


def zone_evidence(z: ThermalZone) -> Evidence:
    trips = ", ".join(f"{t.kind} {_c(t.temp_c)}" for t in z.trips) or "no trip points"
    now = _c(z.temp_c) if z.temp_c is not None else f"unreadable ({z.error})"
    return Evidence(z.type, f"{now}; {trips}", f"{THERMAL_DIR}/{z.name}")


def check_thermal(state: BoardState, target: Target) -> Note:
    check = NoteId("tuning.thermal", "Thermal zones and their trip points")
    if not state.zones:
        return check.passed("no thermal zones (a VM?): the governor has no heat to watch")
    chosen, missing = select_zones(state.zones, target.zones)
    ev = [zone_evidence(z) for z in (chosen or state.zones)]
    if missing:
        return check.warn(
            f"the plan names {', '.join(missing)}, which this board lacks: the governor "
            "watches nothing there",
            ev,
            "re-plan on this board (slmguard plan --board auto), or name zones of: "
            + ", ".join(z.type for z in state.zones),
        )
    if not chosen:
        return check.passed(
            "no zone has a passive or hot trip point: the kernel does not slow the CPU by "
            "temperature here (a Raspberry Pi's firmware does: tuning.pi_throttle)",
            ev,
        )
    blind = [z for z in chosen if z.temp_c is None]
    if blind:
        return check.warn(
            f"cannot read {', '.join(f'{z.type} ({z.error})' for z in blind)}: the governor "
            "cannot see that heat",
            ev,
        )
    by_room = sorted(chosen, key=lambda z: (z.limit_c or 0) - (z.temp_c or 0))
    z = by_room[0]
    assert z.temp_c is not None and z.limit_c is not None  # chosen zones have both
    room = z.limit_c - z.temp_c
    cool = "improve the cooling (heatsink, fan, airflow) or lower the load"
    if room <= 0:
        return check.fail(
            f"{z.type} at {_c(z.temp_c)}, at or above its limit {_c(z.limit_c)}: the kernel "
            "is slowing the CPU now",
            ev,
            cool,
        )
    if room <= NEAR_C:
        return check.warn(
            f"{z.type} at {_c(z.temp_c)}, {room:.1f} °C below its limit {_c(z.limit_c)}",
            ev,
            cool,
        )
    return check.passed(
        f"hottest watched: {z.type} at {_c(z.temp_c)}, {room:.1f} °C below its limit "
        f"{_c(z.limit_c)}",
        ev,
    )
