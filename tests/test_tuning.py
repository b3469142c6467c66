"""slmguard.tuning: each check fires on a captured board tree set up wrong and passes on
the tree as captured (set up right), and the doctor reports them with evidence and fix.

The trees are tests/fixtures/boards/ (RK3588 ROCK 5B on the Rockchip BSP, Raspberry Pi 5,
Jetson Orin Nano on JetPack 6); tests/boardtuning.py changes one setting the way an
image or an operator leaves it. The real readers read the copied tree.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from boardtuning import (
    cpu_governor,
    cpu_max,
    devfreq_set,
    jetson_mode,
    pi_throttled,
    without_dmc,
    zone_temp,
)
from hostboards import copy_board, plan_for_rk3588
from slmguard.cli import main
from slmguard.host.boardstate import BoardState, read_board_state
from slmguard.plan.planfile import dumps_plan
from slmguard.plan.schema import BoardSpec
from slmguard.tuning import CHECKS, Note, assess, target_for

BIG = (4, 5, 6, 7)


def _state(root: Path) -> BoardState:
    state = read_board_state(root)
    assert state.errors == ()
    return state


def _note(root: Path, check_id: str, plan: Any = None, pinned: Any = None) -> Note:
    state = _state(root)
    notes = {n.id: n for n in assess(state, target_for(state, plan, pinned, "CPUAffinity="))}
    return notes[check_id]


@pytest.fixture
def rk3588(tmp_path: Path) -> Path:
    return copy_board("rk3588-rock5b", tmp_path / "rk3588")


@pytest.fixture
def pi5(tmp_path: Path) -> Path:
    return copy_board("rpi5", tmp_path / "pi5")


@pytest.fixture
def orin(tmp_path: Path) -> Path:
    return copy_board("jetson-orin-nano-devkit", tmp_path / "orin")


def test_every_check_passes_on_each_board_as_captured(tmp_path: Path) -> None:
    """The captured boards, pinned to their big cores, are set up right; but the Orin Nano,
    which boots in its 15W mode (EMC capped), and the captured RK3588 and Pi 5 as
    captured have no warning."""
    for board, pinned in (("rk3588-rock5b", BIG), ("rpi5", None), ("rpi4-aarch64", None)):
        root = copy_board(board, tmp_path / board)
        state = _state(root)
        notes = assess(state, target_for(state, None, pinned, "CPUAffinity="))
        assert [n.id for n in notes] == [
            "tuning.cpufreq",
            "tuning.affinity",
            "tuning.ddr",
            "tuning.accel",
            "tuning.power_mode",
            "tuning.pi_throttle",
            "tuning.thermal",
        ]
        assert {n.severity for n in notes} == {"pass"}, [(n.id, n.summary) for n in notes]
    assert len(CHECKS) == 7


# ---------------------------------------------------------------- CPU clocks


def test_cpufreq_passes_on_schedutil(rk3588: Path) -> None:
    note = _note(rk3588, "tuning.cpufreq", pinned=BIG)
    assert note.severity == "pass" and note.summary == "cpu4-7: schedutil, up to 2400 MHz"
    assert [e.label for e in note.evidence][:2] == ["cpu4-5", "cpu6-7"]


def test_cpufreq_fails_on_powersave(rk3588: Path) -> None:
    cpu_governor(rk3588, 4, "powersave")
    note = _note(rk3588, "tuning.cpufreq", pinned=BIG)
    assert note.severity == "fail"
    assert (
        note.summary
        == "cpu4-5 held at 408 MHz by the powersave governor (hardware maximum 2400 MHz)"
    )
    assert (
        note.fix is not None
        and "/sys/devices/system/cpu/cpufreq/policy4/scaling_governor" in note.fix
    )
    # The little cluster is not the service's: powersave there is not its problem.
    cpu_governor(rk3588, 4, "schedutil")
    cpu_governor(rk3588, 0, "powersave")
    assert _note(rk3588, "tuning.cpufreq", pinned=BIG).severity == "pass"


def test_cpufreq_fails_on_userspace_below_the_top(rk3588: Path) -> None:
    cpu_governor(rk3588, 6, "userspace", cur_khz=1_200_000)
    assert _note(rk3588, "tuning.cpufreq", pinned=BIG).severity == "fail"
    cpu_governor(rk3588, 6, "userspace", cur_khz=2_400_000)
    assert _note(rk3588, "tuning.cpufreq", pinned=BIG).severity == "warn"  # not a scaling one


def test_cpufreq_warns_on_a_capped_maximum(rk3588: Path) -> None:
    cpu_max(rk3588, 6, 1_800_000)
    note = _note(rk3588, "tuning.cpufreq", pinned=BIG)
    assert note.severity == "warn"
    assert note.summary.startswith("cpu6-7 capped at 1800 MHz (scaling_max_freq)")
    assert note.fix is not None and note.fix.startswith("echo 2400000 | sudo tee")


def test_cpufreq_warns_on_a_cooling_device_slowing_the_cores(rk3588: Path) -> None:
    (rk3588 / "sys/class/thermal/cooling_device1/cur_state").write_text("3\n")
    note = _note(rk3588, "tuning.cpufreq", pinned=BIG)
    assert note.severity == "warn" and "cpu4-5 slowed by a thermal cooling device" in note.summary


def test_cpufreq_on_a_vm(tmp_path: Path) -> None:
    root = tmp_path / "vm"
    (root / "sys/devices/system/cpu").mkdir(parents=True)
    (root / "sys/devices/system/cpu/online").write_text("0-1\n")
    note = _note(root, "tuning.cpufreq")
    assert note.severity == "pass" and "no cpufreq" in note.summary


# ---------------------------------------------------------------- affinity


def test_affinity(rk3588: Path) -> None:
    plan = plan_for_rk3588()
    assert _note(rk3588, "tuning.affinity", plan).severity == "pass"  # the plan's 4-7, 4 threads
    wide = dataclasses.replace(plan, cpu_affinity=())
    note = _note(rk3588, "tuning.affinity", wide)
    assert note.severity == "warn" and "little cores cpu0-3" in note.summary
    assert note.fix is not None and "CPUAffinity=4-7" in note.fix and "--n-threads 4" in note.fix
    eight = dataclasses.replace(plan, engine=dataclasses.replace(plan.engine, n_threads=8))
    note = _note(rk3588, "tuning.affinity", eight)
    assert note.severity == "warn" and note.summary.startswith("8 threads on 4 big cores")


# ---------------------------------------------------------------- DDR and accelerators


def test_ddr_passes_with_dmc(rk3588: Path) -> None:
    note = _note(rk3588, "tuning.ddr")
    assert note.severity == "pass" and note.summary == "dmc: dmc_ondemand, up to 2112 MHz"
    assert note.evidence[0].source == "sys/class/devfreq/dmc"


def test_ddr_warns_without_dmc(rk3588: Path) -> None:
    without_dmc(rk3588)
    note = _note(rk3588, "tuning.ddr")
    assert note.severity == "warn"
    assert note.summary.startswith("no DMC devfreq on this RK3588")
    assert note.fix is not None and "dmc" in note.fix and "bootloader" in note.fix


def test_ddr_warns_when_the_top_is_capped(rk3588: Path) -> None:
    devfreq_set(rk3588, "dmc", max_hz=1_560_000_000)
    note = _note(rk3588, "tuning.ddr")
    assert note.severity == "warn"
    assert note.summary == (
        "the DDR controller (dmc) cannot reach its top frequency: max_freq 1560 MHz of 2112 MHz"
    )
    assert note.fix == (
        "echo 2112000000 | sudo tee /sys/class/devfreq/dmc/max_freq (a Jetson's power mode "
        "sets it: see tuning.power_mode)"
    )


def test_ddr_fails_on_powersave(rk3588: Path) -> None:
    devfreq_set(rk3588, "dmc", governor="powersave")
    note = _note(rk3588, "tuning.ddr")
    assert note.severity == "fail" and "held at 528 MHz by the powersave governor" in note.summary
    assert note.fix == "echo performance | sudo tee /sys/class/devfreq/dmc/governor"


def test_ddr_elsewhere_has_no_dmc(pi5: Path) -> None:
    assert _note(pi5, "tuning.ddr").severity == "pass"


def test_npu_clock_matters_when_the_plan_uses_it(rk3588: Path) -> None:
    devfreq_set(rk3588, "fdab0000.npu", governor="powersave")
    assert _note(rk3588, "tuning.accel").severity == "warn"  # no plan: not known to be needed
    plan = plan_for_rk3588()  # reserves NPU memory
    note = _note(rk3588, "tuning.accel", plan)
    assert note.severity == "fail" and "the NPU (fdab0000.npu) is held at" in note.summary
    devfreq_set(rk3588, "fdab0000.npu", governor="rknpu_ondemand")
    note = _note(rk3588, "tuning.accel", plan)
    assert note.severity == "pass" and note.summary.endswith("(the plan uses the NPU)")


# ---------------------------------------------------------------- Jetson power modes


def test_orin_boots_in_15w_with_the_memory_clock_capped(orin: Path) -> None:
    note = _note(orin, "tuning.power_mode")
    assert note.severity == "warn"
    assert note.summary == (
        "mode 15W caps the memory clock (EMC) at 2133 MHz: decoding is bound by memory bandwidth"
    )
    assert note.fix == "sudo nvpmodel -m 1 (25W) or sudo nvpmodel -m 2 (MAXN_SUPER)"
    assert note.evidence[0].label == "* mode 0 15W"
    # The CPU cap is the power mode's, and tuning.cpufreq says so instead of warning twice.
    cpu = _note(orin, "tuning.cpufreq")
    assert cpu.severity == "pass" and "the cap of power mode 15W" in cpu.summary


@pytest.mark.parametrize(("mode", "name"), [(1, "25W"), (2, "MAXN_SUPER")])
def test_orin_modes_with_the_memory_at_its_top(orin: Path, mode: int, name: str) -> None:
    jetson_mode(orin, mode)
    note = _note(orin, "tuning.power_mode")
    assert note.severity == "pass" and note.summary.startswith(f"mode {name}:")
    assert _note(orin, "tuning.cpufreq").severity == "pass"


def test_orin_7w_takes_the_plans_cores_offline(orin: Path) -> None:
    plan = plan_for_rk3588(
        board=BoardSpec("jetson-orin-nano-8g", 8 * 10**9, cpus=tuple(range(6)), big_cores=()),
        cpu_affinity=tuple(range(6)),
    )
    plan = dataclasses.replace(plan, engine=dataclasses.replace(plan.engine, n_threads=6))
    jetson_mode(orin, 3)
    note = _note(orin, "tuning.power_mode", plan)
    assert note.severity == "fail"
    # The plan pins 0-5 but the board has 0-3 online: the check compares with the mode.
    assert note.summary.startswith("mode 7W")


def test_orin_7w_against_the_pinned_cores(orin: Path) -> None:
    jetson_mode(orin, 3)
    (orin / "sys/devices/system/cpu/online").write_text("0-5\n")  # before nvpmodel applied it
    note = _note(orin, "tuning.power_mode", pinned=range(6))
    assert note.severity == "fail" and note.summary == "mode 7W takes cpu4-5 offline"


# ---------------------------------------------------------------- the Pi's throttle flags


@pytest.mark.parametrize(
    ("value", "severity", "summary"),
    [
        (0x0, "pass", "no under-voltage, capping or throttling, now or since boot"),
        (0x50005, "fail", "under-voltage now: the firmware slows the board down"),
        (0x40004, "fail", "the firmware is throttling the CPU now"),
        (0x80008, "warn", "now: soft temperature limit"),
        (0x20002, "warn", "now: ARM frequency capped"),
        (0x50000, "warn", "since boot: under-voltage, throttled (not now)"),
    ],
)
def test_pi5_throttle_flags(pi5: Path, value: int, severity: str, summary: str) -> None:
    pi_throttled(pi5, value)
    note = _note(pi5, "tuning.pi_throttle")
    assert (note.severity, note.summary) == (severity, summary)
    assert note.evidence[0].value.startswith(f"{value:#x}")
    if severity != "pass":
        assert note.fix


def test_a_pi_without_the_flags_is_unknown(pi5: Path) -> None:
    (pi5 / "sys/devices/platform/soc@107c000000/soc@107c000000:firmware/get_throttled").unlink()
    assert _note(pi5, "tuning.pi_throttle").severity == "unknown"


# ---------------------------------------------------------------- thermal zones


def test_thermal_passes_warns_and_fails(rk3588: Path) -> None:
    note = _note(rk3588, "tuning.thermal")
    assert note.severity == "pass" and note.summary.startswith("hottest watched: soc-thermal")
    zone_temp(rk3588, 1, 78_500)  # bigcore0-thermal, passive at 85 °C
    note = _note(rk3588, "tuning.thermal")
    assert note.severity == "warn"
    assert note.summary == "bigcore0-thermal at 78.5 °C, 6.5 °C below its limit 85.0 °C"
    zone_temp(rk3588, 1, 85_000)
    note = _note(rk3588, "tuning.thermal")
    assert note.severity == "fail" and "the kernel is slowing the CPU now" in note.summary


def test_thermal_zones_the_plan_names(rk3588: Path) -> None:
    plan = plan_for_rk3588()
    named = dataclasses.replace(
        plan, board=dataclasses.replace(plan.board, thermal_zones=("bigcore1-thermal",))
    )
    zone_temp(rk3588, 1, 86_000)  # bigcore0 is hot, but the plan watches bigcore1
    assert _note(rk3588, "tuning.thermal", named).severity == "pass"
    missing = dataclasses.replace(
        plan, board=dataclasses.replace(plan.board, thermal_zones=("cpu-thermal",))
    )
    note = _note(rk3588, "tuning.thermal", missing)
    assert note.severity == "warn" and note.summary.startswith("the plan names cpu-thermal")


def test_thermal_on_the_pi5_and_on_a_vm(pi5: Path, tmp_path: Path) -> None:
    note = _note(pi5, "tuning.thermal")
    assert note.severity == "pass" and "no zone has a passive or hot trip point" in note.summary
    vm = tmp_path / "vm"
    (vm / "sys/devices/system/cpu").mkdir(parents=True)
    (vm / "sys/devices/system/cpu/online").write_text("0\n")
    assert "no thermal zones" in _note(vm, "tuning.thermal").summary


# ---------------------------------------------------------------- through the doctor


def _doctor(root: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    with pytest.raises(SystemExit):
        main(["doctor", "--root", str(root), "--json", *extra])
    out = json.loads(capsys.readouterr().out)
    return {c["id"]: c for c in out["checks"]}


def test_doctor_reports_the_tuning_with_the_units_cores(
    rk3588: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unit = rk3588 / "etc/systemd/system/slmguard.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/usr/bin/slmguard serve\nCPUAffinity=4-7\n")
    plan = rk3588.parent / "plan.json"
    plan.write_text(dumps_plan(plan_for_rk3588()))
    cpu_governor(rk3588, 6, "powersave")
    without_dmc(rk3588)
    checks = _doctor(rk3588, capsys, "--plan", str(plan))
    cpufreq = checks["tuning.cpufreq"]
    assert cpufreq["severity"] == "fail" and cpufreq["summary"].startswith("cpu6-7 held at 408 MHz")
    cores = next(e for e in cpufreq["evidence"] if e["label"] == "cores")
    assert cores["value"] == "4-7" and cores["source"].startswith(
        "CPUAffinity= of slmguard.service"
    )
    sources = [e["source"] for e in cpufreq["evidence"] if e["label"].startswith("cpu")]
    assert sources[0] == str(rk3588 / "sys/devices/system/cpu/cpu4/cpufreq")
    assert checks["tuning.ddr"]["severity"] == "warn"
    assert checks["tuning.affinity"]["severity"] == "pass"
    for check in ("tuning.power_mode", "tuning.pi_throttle", "tuning.thermal"):
        assert checks[check]["severity"] == "pass", checks[check]


def test_doctor_on_the_orin_in_7w(orin: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jetson_mode(orin, 3)
    checks = _doctor(orin, capsys)
    mode = checks["tuning.power_mode"]
    # Without a plan or a unit the service may run on every online core (0-3 in 7W), so
    # the mode's offline cores are not the service's; its memory cap still is.
    assert mode["severity"] == "warn" and "EMC" in mode["summary"]
    assert mode["evidence"][-1]["source"] == str(orin / "var/lib/nvpmodel/status")
