"""host.devfreq, host.nvpmodel, host.pithrottle, the trip points of host.thermal and
host.boardstate: the board-tuning readers, on the captured board trees and on broken files."""

from __future__ import annotations

from pathlib import Path

import pytest

from boardtuning import jetson_mode, pi_throttled, write
from hostboards import copy_board
from hosttree import build_tree
from slmguard.errors import HostReadError
from slmguard.host import devfreq, nvpmodel, pithrottle, procfs, thermal
from slmguard.host.boardstate import read_board_state

# ---------------------------------------------------------------- devfreq


def test_rk3588_devfreq_devices(tmp_path: Path) -> None:
    devices = {d.name: d for d in devfreq.read_devfreq(copy_board("rk3588-rock5b", tmp_path))}
    assert [(d.name, d.kind) for d in devices.values()] == [
        ("dmc", "memory"),
        ("fb000000.gpu", "gpu"),
        ("fdab0000.npu", "npu"),
    ]
    dmc = devices["dmc"]
    assert dmc.governor == "dmc_ondemand" and dmc.top_hz == 2_112_000_000
    assert dmc.available_hz == (528_000_000, 1_068_000_000, 1_560_000_000, 2_112_000_000)
    assert dmc.cur_hz == 528_000_000 and dmc.load_pct == 6.0
    assert "performance" in dmc.available_governors
    assert not dmc.capped and not dmc.pinned_low
    assert dmc.source == "sys/class/devfreq/dmc"


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("dmc", "memory"),
        ("13c00000.dram-controller", "memory"),
        ("mbus", "memory"),
        ("fb000000.gpu", "gpu"),
        ("17000000.gpu", "gpu"),
        ("fdab0000.npu", "npu"),
        ("ff9a0000.gpu-mali", "gpu"),
        ("dmcfoo", "other"),  # "dmc" only as a word of its own
        ("15340000.vic", "other"),
    ],
)
def test_device_kind(name: str, kind: str) -> None:
    assert devfreq.device_kind(name) == kind


def test_capped_and_pinned_low(tmp_path: Path) -> None:
    base = "sys/class/devfreq/dmc"
    tree = {
        f"{base}/available_frequencies": "528000000 2112000000\n",
        f"{base}/max_freq": "1560000000\n",
        f"{base}/min_freq": "528000000\n",
        f"{base}/cur_freq": "528000000\n",
        f"{base}/governor": "powersave\n",
    }
    (d,) = devfreq.read_devfreq(build_tree(tmp_path, tree))
    assert d.capped and d.pinned_low
    write(tmp_path, f"{base}/governor", "userspace\n")
    write(tmp_path, f"{base}/cur_freq", "2112000000\n")
    (d,) = devfreq.read_devfreq(tmp_path)
    assert not d.pinned_low  # userspace at the top holds nothing down


def test_garbled_devfreq_files(tmp_path: Path) -> None:
    base = "sys/class/devfreq/fb000000.gpu"
    tree = {
        f"{base}/available_frequencies": "fast slow " + "1 " * 500 + "\n",
        f"{base}/cur_freq": "busy\n",
        f"{base}/load": "lots\n",
        f"{base}/governor": "\n",
    }
    (d,) = devfreq.read_devfreq(build_tree(tmp_path, tree))
    assert d.available_hz == (1,) and d.cur_hz is None and d.load_pct is None
    assert d.governor is None and d.max_hz is None
    assert len(devfreq.parse_hz_list(" ".join(str(n) for n in range(1000)))) == devfreq.MAX_FREQS


def test_no_devfreq_on_a_vm(tmp_path: Path) -> None:
    assert devfreq.read_devfreq(tmp_path) == ()


# ---------------------------------------------------------------- nvpmodel


def test_orin_nano_power_modes(tmp_path: Path) -> None:
    root = copy_board("jetson-orin-nano-devkit", tmp_path)
    modes = nvpmodel.read_power_modes(root)
    assert modes is not None
    assert [(m.id, m.name) for m in modes.modes] == [
        (0, "15W"),
        (1, "25W"),
        (2, "MAXN_SUPER"),
        (3, "7W"),
    ]
    assert modes.default_id == 0 and modes.current_id == 0
    seven = modes.mode(3)
    assert seven is not None and seven.offline_cores == (4, 5) and seven.cpu_max_khz == 960_000
    maxn = modes.mode(2)
    assert maxn is not None and maxn.emc_max_hz == -1 and maxn.cpu_max_khz == -1
    jetson_mode(root, 1)
    again = nvpmodel.read_power_modes(root)
    assert again is not None and again.active is not None and again.active.name == "25W"


def test_status_absent_means_the_default(tmp_path: Path) -> None:
    root = copy_board("jetson-orin-nano-devkit", tmp_path)
    (root / nvpmodel.STATUS).unlink()
    modes = nvpmodel.read_power_modes(root)
    assert modes is not None and modes.current_id is None and modes.active_id == 0


@pytest.mark.parametrize(
    ("text", "want"),
    [("pmode:0002 fmode:quiet\n", 2), ("pmode:0000\n", 0), ("mode 2\n", None), ("", None)],
)
def test_parse_status(text: str, want: int | None) -> None:
    assert nvpmodel.parse_status(text) == want


def test_hostile_nvpmodel_conf(tmp_path: Path) -> None:
    blocks = "".join(
        f"< POWER_MODEL ID={i} NAME=M{i} >\nCPU_ONLINE CORE_99999 0\nEMC MAX_FREQ x\n"
        for i in range(100)
    )
    build_tree(tmp_path, {nvpmodel.CONF: blocks, nvpmodel.STATUS: "pmode:zz\n"})
    modes = nvpmodel.read_power_modes(tmp_path)
    assert modes is not None and len(modes.modes) == nvpmodel.MAX_MODES
    assert modes.modes[0].offline_cores == () and modes.modes[0].emc_max_hz is None
    assert modes.current_id is None and modes.notes


def test_nvpmodel_conf_without_modes(tmp_path: Path) -> None:
    build_tree(tmp_path, {nvpmodel.CONF: "< PM_CONFIG DEFAULT=0 >\n"})
    with pytest.raises(HostReadError, match="no POWER_MODEL"):
        nvpmodel.read_power_modes(tmp_path)
    assert nvpmodel.read_power_modes(tmp_path / "elsewhere") is None


# ---------------------------------------------------------------- the Pi's throttle flags


@pytest.mark.parametrize(
    ("value", "now", "since"),
    [
        (0x0, (), ()),
        (0x50005, ("under-voltage", "throttled"), ("under-voltage", "throttled")),
        (0x50000, (), ("under-voltage", "throttled")),
        (0x80008, ("soft temperature limit",), ("soft temperature limit",)),
        (0x20002, ("ARM frequency capped",), ("ARM frequency capped",)),
    ],
)
def test_pi5_flags(
    tmp_path: Path, value: int, now: tuple[str, ...], since: tuple[str, ...]
) -> None:
    root = copy_board("rpi5", tmp_path)
    pi_throttled(root, value)
    flags = pithrottle.read_throttle_flags(root)
    assert isinstance(flags, pithrottle.ThrottleFlags)
    assert (flags.value, flags.active, flags.occurred) == (value, now, since)
    assert flags.source.endswith("soc@107c000000:firmware/get_throttled")


def test_pi4_path_and_the_known_paths(tmp_path: Path) -> None:
    flags = pithrottle.read_throttle_flags(copy_board("rpi4-aarch64", tmp_path / "pi4"))
    assert isinstance(flags, pithrottle.ThrottleFlags) and flags.value == 0
    # Without the driver's directory (an older kernel's sysfs), the device path is found.
    build_tree(tmp_path / "old", {pithrottle.KNOWN[0]: "80000\n"})
    flags = pithrottle.read_throttle_flags(tmp_path / "old")
    assert isinstance(flags, pithrottle.ThrottleFlags)
    assert flags.describe() == "0x80000: since boot soft temperature limit"


@pytest.mark.parametrize("text", ["throttled\n", "123456789\n", "\n", "0xg\n"])
def test_garbled_get_throttled(tmp_path: Path, text: str) -> None:
    build_tree(tmp_path, {pithrottle.KNOWN[1]: text})
    found = pithrottle.read_throttle_flags(tmp_path)
    assert isinstance(found, str) and "not a hex word" in found


def test_not_a_pi(tmp_path: Path) -> None:
    assert pithrottle.read_throttle_flags(copy_board("rk3588-rock5b", tmp_path)) is None


# ---------------------------------------------------------------- thermal trips


def test_rk3588_trip_points(tmp_path: Path) -> None:
    zones = {z.type: z for z in thermal.read_thermal_zones(copy_board("rk3588-rock5b", tmp_path))}
    soc = zones["soc-thermal"]
    assert [(t.temp_c, t.kind, t.hyst_c) for t in soc.trips] == [
        (75.0, "passive", 2.0),
        (85.0, "passive", 2.0),
        (115.0, "critical", 2.0),
    ]
    assert soc.limit_c == 75.0 and zones["bigcore0-thermal"].limit_c == 85.0
    assert zones["gpu-thermal"].limit_c is None  # only a critical trip
    watched, missing = thermal.select_zones(zones.values())
    assert [z.type for z in watched] == [
        "soc-thermal",
        "bigcore0-thermal",
        "bigcore1-thermal",
        "littlecore-thermal",
    ]
    named, missing = thermal.select_zones(
        zones.values(), ("bigcore1-thermal", "thermal_zone0", "x")
    )
    assert [z.type for z in named] == ["soc-thermal", "bigcore1-thermal"] and missing == ("x",)


def test_pi5_zone_has_no_limit(tmp_path: Path) -> None:
    (zone,) = thermal.read_thermal_zones(copy_board("rpi5", tmp_path))
    assert zone.limit_c is None and zone.critical_c == 110.0
    assert [t.kind for t in zone.trips] == ["critical", "active", "active", "active", "active"]


def test_zone_temp_alone(tmp_path: Path) -> None:
    root = copy_board("rk3588-rock5b", tmp_path)
    dirs = thermal.zone_dirs(root)
    assert thermal.read_zone_temp(dirs[1]) == (45.3, None)
    write(root, "sys/class/thermal/thermal_zone1/temp", "hot\n")
    assert thermal.read_zone_temp(dirs[1]) == (None, "not a temperature: 'hot'")
    (root / "sys/class/thermal/thermal_zone1/temp").unlink()
    assert thermal.read_zone_temp(dirs[1]) == (None, "no temp file")


# ---------------------------------------------------------------- load and the whole state


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("0.52 0.58 0.59 1/467 12345\n", (0.52, 0.58, 0.59)),
        ("1.0 2.0\n", None),
        ("nan 1 1 1/1 1\n", None),
        ("x y z\n", None),
    ],
)
def test_loadavg(text: str, want: tuple[float, float, float] | None) -> None:
    assert procfs.parse_loadavg(text) == want


@pytest.mark.parametrize(
    "board", ["rk3588-rock5b", "rpi5", "jetson-orin-nano-devkit", "rpi4-aarch64"]
)
def test_board_state_of_each_board(tmp_path: Path, board: str) -> None:
    state = read_board_state(copy_board(board, tmp_path), clock=lambda: 1.0)
    assert state.errors == () and state.taken_unix_s == 1.0
    assert state.cpufreq and state.zones and state.compatible
    data = state.as_dict()
    assert data["root"] == str(tmp_path) and isinstance(data["cpufreq"], list)
    if board == "jetson-orin-nano-devkit":
        assert data["power_mode"] == {"id": 0, "name": "15W", "set_since_flashing": True}
    if board == "rpi5":
        assert data["pi_flags"]["hex"] == "0x0" and data["pi_flags"]["now"] == []


def test_board_state_says_what_it_could_not_read(tmp_path: Path) -> None:
    root = copy_board("jetson-orin-nano-devkit", tmp_path)
    write(root, nvpmodel.CONF, "nothing here\n")
    write(root, pithrottle.KNOWN[0], "zz\n")
    state = read_board_state(root)
    assert state.power_modes is None and state.pi_flags is None
    assert any("no POWER_MODEL" in e for e in state.errors)
    assert any("not a hex word" in e for e in state.errors)


def test_board_state_of_this_machine() -> None:
    state = read_board_state(Path("/"))
    assert state.online  # whatever else this host lacks (a VM: cpufreq, zones, devfreq)
    assert state.as_dict()["online"] == list(state.online)
