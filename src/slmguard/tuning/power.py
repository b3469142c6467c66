"""Tuning checks on power: the Jetson's power mode and the Raspberry Pi firmware's flags.

Owns ``tuning.power_mode``: the nvpmodel mode in force must keep the service's cores
online (a 7W mode takes two of six offline, and the plan's threads then share four) and
must not cap the memory controller (EMC) below what another mode allows, since decoding
is bound by memory bandwidth (on an Orin Nano the 25W mode's EMC cap is the board's top,
and gives more tokens per joule than MAXN). And ``tuning.pi_throttle``: the firmware's
``get_throttled`` flags, now (a failure for under-voltage or throttling, a warning for a
capped clock or the soft temperature limit) and since boot (a warning). Pure: reads only
the :class:`~slmguard.host.boardstate.BoardState`.
"""

from __future__ import annotations

from slmguard.host import nvpmodel, pithrottle
from slmguard.host.boardstate import BoardState
from slmguard.host.nvpmodel import PowerMode, PowerModes
from slmguard.tuning.notes import Evidence, Note, NoteId, Target, cpu_list, mhz


def _cap(value: int | None, unit_hz: int) -> str:
    if value is None:
        return "not set"
    return "no cap" if value < 0 else mhz(value, unit_hz)


def _mode_evidence(mode: PowerMode, active: bool) -> Evidence:
    value = (
        f"CPU {_cap(mode.cpu_max_khz, 1000)}, GPU {_cap(mode.gpu_max_hz, 1)}, "
        f"EMC {_cap(mode.emc_max_hz, 1)}"
    )
    if mode.offline_cores:
        value += f", cpu{cpu_list(mode.offline_cores)} offline"
    return Evidence(f"{'* ' if active else ''}mode {mode.id} {mode.name}", value, nvpmodel.CONF)


def _emc_rank(mode: PowerMode) -> float:
    """How fast a mode lets the memory run: no cap beats any cap; unknown ranks last."""
    if mode.emc_max_hz is None:
        return -1.0
    return float("inf") if mode.emc_max_hz < 0 else float(mode.emc_max_hz)


def _fastest_memory(modes: PowerModes) -> list[PowerMode]:
    """The modes whose EMC cap is the top one (an uncapped mode ties with the highest cap)."""
    finite = [m.emc_max_hz for m in modes.modes if m.emc_max_hz is not None and m.emc_max_hz > 0]
    top = max(finite) if finite else None
    return [
        m
        for m in modes.modes
        if _emc_rank(m) >= (top or float("inf")) or _emc_rank(m) == float("inf")
    ]


def check_power_mode(state: BoardState, target: Target) -> Note:
    check = NoteId("tuning.power_mode", "Jetson power mode (nvpmodel)")
    modes = state.power_modes
    if modes is None:
        return check.passed("not a Jetson (no /etc/nvpmodel.conf)")
    active = modes.active
    ev = [_mode_evidence(m, m is active) for m in modes.modes]
    how = "set with nvpmodel -m" if modes.current_id is not None else "the default, never set"
    ev.append(Evidence("mode in force", f"{modes.active_id} ({how})", nvpmodel.STATUS))
    if active is None:
        return check.unknown(
            f"mode {modes.active_id} is not one of nvpmodel.conf's "
            f"({', '.join(str(m.id) for m in modes.modes)})",
            ev,
        )
    fast = _fastest_memory(modes)
    suggest = " or ".join(f"sudo nvpmodel -m {m.id} ({m.name})" for m in fast) or None
    offline = sorted(set(active.offline_cores) & set(target.cpus))
    if offline:
        left = len(set(target.cpus) - set(active.offline_cores))
        threads = f"; the plan's {target.threads} threads share {left}" if target.threads else ""
        return check.fail(
            f"mode {active.name} takes cpu{cpu_list(offline)} offline{threads}",
            ev,
            suggest,
        )
    if active not in fast and fast and _emc_rank(active) < _emc_rank(fast[0]):
        return check.warn(
            f"mode {active.name} caps the memory clock (EMC) at {_cap(active.emc_max_hz, 1)}: "
            "decoding is bound by memory bandwidth",
            ev,
            suggest,
        )
    return check.passed(f"mode {active.name}: the memory clock at its top, every core online", ev)


def _is_pi(state: BoardState) -> bool:
    return state.is_soc("raspberrypi,") or state.is_soc("brcm,bcm27")


def check_pi_throttle(state: BoardState, target: Target) -> Note:
    check = NoteId("tuning.pi_throttle", "Raspberry Pi firmware throttle flags")
    flags = state.pi_flags
    if flags is None:
        if _is_pi(state):
            return check.unknown(
                "a Raspberry Pi whose firmware driver shows no get_throttled (or it could not "
                "be read: see the unread list)",
                [Evidence("get_throttled", "not found", pithrottle.DRIVER_DIR)],
            )
        return check.passed("not a Raspberry Pi (no firmware throttle flags)")
    ev = [Evidence("get_throttled", flags.describe(), flags.source)]
    power = (
        "a supply that holds 5 V under load (the official 27 W USB-C supply on a Pi 5) "
        "and a short cable"
    )
    cooling = "cool the board: a heatsink with a fan (the Pi 5's Active Cooler)"
    if flags.now(pithrottle.UNDER_VOLTAGE):
        return check.fail("under-voltage now: the firmware slows the board down", ev, power)
    if flags.now(pithrottle.THROTTLED):
        return check.fail("the firmware is throttling the CPU now", ev, cooling + ", or " + power)
    if flags.now(pithrottle.CAPPED) or flags.now(pithrottle.SOFT_TEMP_LIMIT):
        return check.warn(f"now: {', '.join(flags.active)}", ev, cooling)
    if flags.occurred:
        fix = power if flags.since_boot(pithrottle.UNDER_VOLTAGE) else cooling
        return check.warn(f"since boot: {', '.join(flags.occurred)} (not now)", ev, fix)
    return check.passed("no under-voltage, capping or throttling, now or since boot", ev)
