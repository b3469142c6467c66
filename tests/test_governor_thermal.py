"""Heat as a governor input: the pure rules, then the governor reading a real thermal tree.

The tree is the captured RK3588 board (tests/fixtures/boards/rk3588-rock5b) and the Pi
5's under a temporary root; the tests write each zone's ``temp`` file (and the Pi
firmware's ``get_throttled``) as a board heating up and cooling down would, with an
injected clock for the hold times. The engine is a recording stand-in here; the real
server and engine are in test_governor_heat_live.py.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from boardtuning import pi_throttled, zone_temp
from hostboards import copy_board
from slmguard.errors import ConfigError, OverloadedError
from slmguard.governor.heat import HeatSignal
from slmguard.governor.request import SizedRequest
from slmguard.governor.runtime import Governor, GovernorConfig
from slmguard.governor.signal import MemorySignal
from slmguard.governor.thermal import (
    HeatLevel,
    HeatSample,
    HeatSettings,
    HeatState,
    ZoneHeat,
    admission,
    decide_heat,
    level_for,
    max_tokens_cap,
    slots_allowed,
)
from slmguard.host.pithrottle import ThrottleFlags
from test_governor_runtime import CG, Clock, RecordingEngine, host

S = HeatSettings(hold_s=30.0)
REQUEST = SizedRequest("completions", prompt_tokens=10, max_tokens=10)


def sample(temp_c: float | None, limit_c: float = 85.0, flags: int | None = None) -> HeatSample:
    zone = ZoneHeat("thermal_zone1", "bigcore0-thermal", limit_c, temp_c, None if temp_c else "x")
    firmware = None if flags is None else ThrottleFlags(flags, "get_throttled")
    return HeatSample((zone,), firmware, 0.0)


# ---------------------------------------------------------------- the rules


@pytest.mark.parametrize(
    ("temp", "level"),
    [
        (40.0, HeatLevel.COOL),
        (74.9, HeatLevel.COOL),
        (75.0, HeatLevel.WARM),  # 10 °C of room
        (79.9, HeatLevel.WARM),
        (80.0, HeatLevel.HOT),  # 5 °C
        (84.9, HeatLevel.HOT),
        (85.0, HeatLevel.LIMIT),  # at the passive trip
        (97.0, HeatLevel.LIMIT),
    ],
)
def test_level_by_room(temp: float, level: HeatLevel) -> None:
    assert level_for(sample(temp), S) == level


@pytest.mark.parametrize(
    ("flags", "level"),
    [
        (0x0, HeatLevel.COOL),
        (0x50000, HeatLevel.COOL),  # since boot only: not now
        (0x20002, HeatLevel.WARM),  # ARM frequency capped
        (0x80008, HeatLevel.HOT),  # soft temperature limit
        (0x40004, HeatLevel.LIMIT),  # throttled
        (0x50005, HeatLevel.LIMIT),  # under-voltage and throttled
    ],
)
def test_level_by_firmware_flags(flags: int, level: HeatLevel) -> None:
    assert level_for(HeatSample(firmware=ThrottleFlags(flags, "f")), S) == level
    # With a zone, the higher of the two.
    assert level_for(sample(81.0, flags=flags), S) == max(level, HeatLevel.HOT)


def test_rising_is_immediate_falling_one_level_per_hold() -> None:
    st = HeatState()
    st, steps = decide_heat(st, sample(86.0), 100.0, S, 4)
    assert st.level == HeatLevel.LIMIT
    ((step),) = steps
    assert (step.from_level, step.to_level, step.reason) == (
        HeatLevel.COOL,
        HeatLevel.LIMIT,
        "rising",
    )
    assert (step.zone, step.temp_c, step.limit_c, step.slots, step.max_tokens_cap) == (
        "bigcore0-thermal",
        86.0,
        85.0,
        1,
        128,
    )
    # Below the trip but within the hysteresis (3 °C): no step, however long.
    st, steps = decide_heat(st, sample(83.0), 110.0, S, 4)
    st, steps = decide_heat(st, sample(83.0), 500.0, S, 4)
    assert st.level == HeatLevel.LIMIT and steps == ()
    # Cool enough for one step down: only after the hold.
    st, steps = decide_heat(st, sample(70.0), 510.0, S, 4)
    assert st.level == HeatLevel.LIMIT and steps == ()
    st, steps = decide_heat(st, sample(70.0), 540.0, S, 4)
    assert st.level == HeatLevel.HOT and steps[0].reason == "cooled" and steps[0].slots == 1
    # Each further step waits a full hold again, one level at a time.
    st, steps = decide_heat(st, sample(40.0), 560.0, S, 4)
    assert st.level == HeatLevel.HOT and steps == ()
    st, steps = decide_heat(st, sample(40.0), 570.0, S, 4)
    assert st.level == HeatLevel.WARM and steps[0].slots == 2 and steps[0].max_tokens_cap is None
    st, steps = decide_heat(st, sample(40.0), 600.0, S, 4)
    assert st.level == HeatLevel.COOL and steps[0].slots == 4


def test_a_warm_spell_restarts_the_hold() -> None:
    st = HeatState(HeatLevel.HOT, 0.0)
    st, _ = decide_heat(st, sample(60.0), 10.0, S, 2)
    st, _ = decide_heat(st, sample(79.0), 30.0, S, 2)  # back near the line: the hold restarts
    st, steps = decide_heat(st, sample(60.0), 45.0, S, 2)
    assert st.level == HeatLevel.HOT and steps == ()
    st, steps = decide_heat(st, sample(60.0), 75.0, S, 2)
    assert st.level == HeatLevel.WARM and len(steps) == 1


def test_nothing_readable_changes_nothing() -> None:
    st = HeatState(HeatLevel.HOT, 0.0)
    assert decide_heat(st, sample(None), 1000.0, S, 2) == (st, ())
    assert decide_heat(st, HeatSample(), 1000.0, S, 2) == (st, ())
    off = HeatSettings(enabled=False)
    assert decide_heat(HeatState(), sample(99.0), 1.0, off, 2) == (HeatState(), ())


@pytest.mark.parametrize("planned", [1, 2, 3, 4, 8])
def test_never_below_one_slot(planned: int) -> None:
    slots = [slots_allowed(level, planned) for level in HeatLevel]
    assert slots[0] == planned and all(s >= 1 for s in slots)
    assert slots == sorted(slots, reverse=True)
    assert slots_allowed(HeatLevel.COOL, 0) == 1


def test_cap_and_shedding_by_level() -> None:
    assert [max_tokens_cap(level, S) for level in HeatLevel] == [None, None, 128, 128]
    assert [admission(level, S) for level in HeatLevel][:3] == [None, None, None]
    shed = admission(HeatLevel.LIMIT, S)
    assert shed is not None and (shed.status, shed.code, shed.retry_after_s) == (
        503,
        "thermal_shedding",
        30,
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"hot_margin_c": 10.0},
        {"hot_margin_c": -1.0},
        {"hysteresis_c": -1.0},
        {"hold_s": -1.0},
        {"max_tokens_cap": 0},
        {"interval_s": 0.0},
        {"warm_margin_c": float("nan")},
    ],
)
def test_bad_settings(changes: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="governor heat settings"):
        HeatSettings(**changes)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the governor on a tree


class SlotsEngine(RecordingEngine):
    def planned_slots(self) -> int:
        return 4


def board_governor(
    tmp_path: Path, board: str = "rk3588-rock5b", zones: tuple[str, ...] = ()
) -> tuple[Governor, Path, Clock, SlotsEngine]:
    root = copy_board(board, tmp_path / board)
    host(root)  # the memory cgroup files beside the board's (no memory pressure)
    (root / CG / "memory.current").write_text("0\n")
    clock = Clock()
    engine = SlotsEngine()
    config = GovernorConfig(heat=replace(S, interval_s=1.0), thermal_zones=zones)
    gov = Governor(MemorySignal(root, clock=clock), config, 2048, engine=engine, root=root,
                   clock=clock)  # fmt: skip
    return gov, root, clock, engine


def heat(gov: Governor, clock: Clock, seconds: float = 1.0) -> None:
    clock.now += seconds
    gov.heat_tick()


def slot_limits(engine: RecordingEngine) -> list[object]:
    return [arg for call, arg in engine.calls if call == "limit_slots"]


def test_rk3588_heats_and_cools(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    gov, root, clock, engine = board_governor(tmp_path)
    caplog.set_level(logging.INFO, logger="slmguard.governor")
    heat(gov, clock)
    assert gov.heat.level == HeatLevel.COOL and slot_limits(engine) == []
    # bigcore0-thermal (zone 1) heats towards its passive trip at 85 °C.
    for milli, level in ((76_000, "warm"), (81_500, "hot"), (85_500, "limit")):
        zone_temp(root, 1, milli)
        heat(gov, clock)
        assert gov.heat.level.label == level
    assert slot_limits(engine) == [2, 1, 1]
    assert gov.max_tokens_cap() == 128
    refusal = gov.admit(REQUEST)
    assert isinstance(refusal, OverloadedError) and refusal.code == "thermal_shedding"
    # Cools: one level per hold (30 s), the slots back last.
    zone_temp(root, 1, 60_000)
    levels = []
    for _ in range(120):
        heat(gov, clock)
        levels.append(gov.heat.level.label)
    assert [levels[0], levels[29], levels[30], levels[60], levels[90]] == [
        "limit",
        "limit",
        "hot",
        "warm",
        "cool",
    ]
    assert slot_limits(engine) == [2, 1, 1, 1, 2, None]
    assert gov.admit(REQUEST) is None and gov.max_tokens_cap() is None
    steps = gov.status()["thermal"]["steps"]
    assert [(s["from_level"], s["to_level"], s["temp_c"]) for s in steps] == [
        ("cool", "warm", 76.0),
        ("warm", "hot", 81.5),
        ("hot", "limit", 85.5),
        ("limit", "hot", 60.0),
        ("hot", "warm", 60.0),
        ("warm", "cool", 60.0),
    ]
    assert all(s["zone"] == "bigcore0-thermal" and s["limit_c"] == 85.0 for s in steps)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("governor.heat")]
    assert len(logged) == 6 and '"temp_c": 85.5' in logged[2] and '"shedding": true' in logged[2]
    assert gov.counters.snapshot()["degradations"] == {
        "heat_hot": 1,
        "heat_limit": 1,
        "heat_warm": 1,
    }
    assert gov.counters.snapshot()["rejections"] == {"thermal_shedding": 1}


def test_reads_at_most_every_interval(tmp_path: Path) -> None:
    gov, root, clock, _engine = board_governor(tmp_path)
    heat(gov, clock)
    zone_temp(root, 1, 90_000)
    heat(gov, clock, 0.5)  # within the interval: the file is not read
    assert gov.heat.level == HeatLevel.COOL
    heat(gov, clock, 0.5)
    assert gov.heat.level == HeatLevel.LIMIT


def test_only_the_zones_the_plan_names(tmp_path: Path) -> None:
    gov, root, clock, _engine = board_governor(tmp_path, zones=("bigcore1-thermal",))
    zone_temp(root, 1, 90_000)  # bigcore0: not watched
    heat(gov, clock)
    thermal = gov.status()["thermal"]
    assert gov.heat.level == HeatLevel.COOL
    assert [z["type"] for z in thermal["zones"]] == ["bigcore1-thermal"]
    zone_temp(root, 2, 80_100)
    heat(gov, clock)
    assert gov.heat.level == HeatLevel.HOT


def test_a_named_zone_the_board_lacks(tmp_path: Path) -> None:
    gov, _root, clock, _engine = board_governor(tmp_path, zones=("cpu-thermal",))
    heat(gov, clock)
    thermal = gov.status()["thermal"]
    assert thermal["zones"] == [] and thermal["zones_missing"] == ["cpu-thermal"]


def test_pi5_firmware_flags(tmp_path: Path) -> None:
    gov, root, clock, engine = board_governor(tmp_path, "rpi5")
    heat(gov, clock)
    assert gov.heat.level == HeatLevel.COOL and gov.status()["thermal"]["zones"] == []
    pi_throttled(root, 0x80008)  # soft temperature limit
    heat(gov, clock)
    assert gov.heat.level == HeatLevel.HOT
    pi_throttled(root, 0xE000E)  # capped and throttled now
    heat(gov, clock)
    assert gov.heat.level == HeatLevel.LIMIT
    step = gov.status()["thermal"]["steps"][-1]
    assert step["firmware"].startswith("0xe000e: now ARM frequency capped, throttled")
    pi_throttled(root, 0xE0000)  # since boot only
    for _ in range(95):
        heat(gov, clock)
    assert gov.heat.level == HeatLevel.COOL and slot_limits(engine)[-1] is None


def test_no_heat_input_on_a_vm(tmp_path: Path) -> None:
    root = host(tmp_path / "vm")
    clock = Clock()
    engine = SlotsEngine()
    gov = Governor(MemorySignal(root, clock=clock), GovernorConfig(), 2048, engine=engine,
                   root=root, clock=clock)  # fmt: skip
    for _ in range(3):
        heat(gov, clock)
    thermal = gov.status()["thermal"]
    assert (thermal["level"], thermal["zones"], thermal["firmware"]) == ("cool", [], None)
    assert slot_limits(engine) == [] and thermal["slots"] == 4


def test_a_governor_that_only_reports_does_not_act(tmp_path: Path) -> None:
    gov, root, clock, engine = board_governor(tmp_path)
    gov.config = replace(gov.config, enabled=False)
    zone_temp(root, 1, 90_000)
    heat(gov, clock)
    assert gov.heat.level == HeatLevel.LIMIT  # reported
    assert slot_limits(engine) == [] and gov.admit(REQUEST) is None  # not acted on


def test_plan_names_the_zones(tmp_path: Path) -> None:
    from hostboards import plan_for_rk3588

    plan = plan_for_rk3588()
    plan = replace(plan, board=replace(plan.board, thermal_zones=("bigcore0-thermal",)))
    config = GovernorConfig.for_model(plan, None, kv_type="f16")
    assert config.thermal_zones == ("bigcore0-thermal",)
    assert GovernorConfig.for_model(None, None, kv_type="f16").thermal_zones == ()


def test_signal_reads_only_the_watched_temps(tmp_path: Path) -> None:
    root = copy_board("rk3588-rock5b", tmp_path / "b")
    signal = HeatSignal(root)
    first = signal.sample()
    assert [z.type for z in first.zones] == [
        "soc-thermal",
        "bigcore0-thermal",
        "bigcore1-thermal",
        "littlecore-thermal",
    ]
    assert first.hottest is not None and first.hottest.type == "soc-thermal"  # 75 °C limit
    zone_temp(root, 3, 84_000)
    assert signal.sample().hottest == ZoneHeat("thermal_zone3", "littlecore-thermal", 85.0, 84.0)
