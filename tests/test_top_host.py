"""host.thermal, host.cpu (busy time, clocks), host.accel, host.files: what top reads."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hosttree import build_tree
from slmguard.host import accel, cpu, devfreq, files, thermal
from toptrees import JETSON_TOP, RK3588_TOP, proc_stat

THIS_MACHINE = Path("/")


# ---------------------------------------------------------------- thermal


def test_rk3588_zones_trips_and_hot(tmp_path: Path) -> None:
    zones = thermal.read_thermal_zones(build_tree(tmp_path, RK3588_TOP))
    assert [z.type for z in zones] == [
        "soc-thermal", "bigcore0-thermal", "bigcore1-thermal", "npu-thermal",
    ]  # fmt: skip
    big0 = zones[1]
    assert big0.temp_c == 86.5 and big0.passive_c == 85.0 and big0.critical_c == 115.0
    assert big0.hot and big0.enabled is True
    assert not zones[0].hot and zones[3].passive_c is None and not zones[3].hot
    assert thermal.hot_zones(zones) == ("bigcore0-thermal",)


def test_rk3588_cpufreq_policies_cooling_and_throttle(tmp_path: Path) -> None:
    root = build_tree(tmp_path, RK3588_TOP)
    freqs = cpu.read_cpufreq(root, range(8))
    assert freqs[4].cur_khz == 1416000 and freqs[4].hw_max_khz == 2256000
    assert freqs[4].policy_cpus == (4, 5) and freqs[0].policy_cpus == (0, 1, 2, 3)
    assert [f.capped for f in freqs] == [False] * 6 + [True, True]
    cooling = thermal.read_cooling_devices(root)
    assert [(c.type, c.cur_state) for c in cooling][:2] == [
        ("cpufreq-cpu0", 0),
        ("cpufreq-cpu4", 3),
    ]
    # cpufreq-cpu4 is in state 3: the policy of cpus 4-5 is slowed (the GPU device is no CPU).
    assert thermal.throttled_cpus(freqs, cooling) == {4, 5}


def test_old_cooling_names_count_policies_in_order() -> None:
    freqs = [
        cpu.CpuFreq(c, 1, 1, 1, policy_cpus=p)
        for c, p in ((0, (0, 1)), (1, (0, 1)), (2, (2, 3)), (3, (2, 3)))
    ]
    cooling = [thermal.CoolingDevice("cooling_device0", "thermal-cpufreq-1", 2, 4)]
    assert thermal.throttled_cpus(freqs, cooling) == {2, 3}
    unknown = [thermal.CoolingDevice("cooling_device0", "thermal-cpufreq-7", 2, 4)]
    assert thermal.throttled_cpus(freqs, unknown) == frozenset()


def test_x86_throttle_count_rise() -> None:
    before = {0: 10, 1: 4}
    after = [cpu.CpuFreq(0, None, None, None, throttle_count=12),
             cpu.CpuFreq(1, None, None, None, throttle_count=4)]  # fmt: skip
    assert thermal.throttle_rises(before, after) == {0}


def test_jetson_zone_without_temp_says_why(tmp_path: Path) -> None:
    zones = thermal.read_thermal_zones(build_tree(tmp_path, JETSON_TOP))
    assert zones[0].type == "cpu-thermal" and zones[0].temp_c is None
    assert zones[0].error == "no temp file"
    assert zones[1].temp_c == 48.5 and zones[1].error is None


@pytest.mark.parametrize(
    ("text", "want"),
    [("45250\n", 45.25), ("-5000", -5.0), ("150", 0.15), ("", None), ("hot", None)],
)
def test_parse_millicelsius(text: str, want: float | None) -> None:
    assert thermal.parse_millicelsius(text) == want


def test_garbled_and_hostile_cpu_lists() -> None:
    assert cpu.parse_cpu_list("0 1 2 3\n") == (0, 1, 2, 3)
    assert cpu.parse_cpu_list("4-5") == (4, 5)
    assert cpu.parse_cpu_list("0-999999999") == ()  # bounded before it allocates
    assert cpu.parse_cpu_list("x") == ()


def test_no_thermal_on_a_vm(tmp_path: Path) -> None:
    assert thermal.read_thermal_zones(tmp_path) == ()
    assert thermal.read_cooling_devices(tmp_path) == ()
    (f,) = cpu.read_cpufreq(tmp_path, [0])
    assert f.cur_khz is None and f.error is None and not f.capped


def test_this_machine_reads_without_error() -> None:
    # Whatever this host has (a VM here has no thermal zones): no exception, no zeros.
    for z in thermal.read_thermal_zones(THIS_MACHINE):
        assert z.temp_c is not None or z.error
    for f in cpu.read_cpufreq(THIS_MACHINE, [0]):
        assert f.cur_khz is None or f.cur_khz > 0


# ---------------------------------------------------------------- cpu: busy time


def test_proc_stat_busy_between_two_reads() -> None:
    a = cpu.parse_proc_stat(proc_stat({0: (100, 900), 1: (500, 500)}))
    b = cpu.parse_proc_stat(proc_stat({0: (150, 1850), 1: (1500, 500)}))
    assert cpu.busy_pct(a[0], b[0]) == pytest.approx(5.0)
    assert cpu.busy_pct(a[1], b[1]) == pytest.approx(100.0)
    assert cpu.busy_pct(a[None], b[None]) == pytest.approx(1050 / 2000 * 100)
    assert cpu.busy_pct(b[0], a[0]) is None  # counters went back (core offline and back)
    assert cpu.busy_pct(None, b[0]) is None


def test_proc_stat_old_kernel_and_garbage() -> None:
    text = "cpu 10 0 10 80\ncpu0 10 0 10 80\ncpufoo 1 2\ncpu1 x y z\ncpu99999 1 1 1 1\n"
    parsed = cpu.parse_proc_stat(text)
    assert set(parsed) == {None, 0}
    assert parsed[0] == cpu.CpuTimes(0, 20, 100)


def test_proc_stat_this_machine() -> None:
    parsed = cpu.read_proc_stat(THIS_MACHINE)
    assert None in parsed and 0 in parsed
    assert parsed[0].total_ticks >= parsed[0].busy_ticks > 0


# ---------------------------------------------------------------- accel


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("NPU load:  Core0: 37%, Core1:  0%, Core2: 12%,\n", (37.0, 0.0, 12.0)),
        ("NPU load: 25%\n", (25.0,)),
        ("garbage\n", ()),
        ("", ()),
    ],
)
def test_parse_rknpu_load(text: str, want: tuple[float, ...]) -> None:
    assert accel.parse_rknpu_load(text) == want


def test_parse_devfreq_and_permille() -> None:
    assert devfreq.parse_load("9@300000000Hz\n") == (9.0, 300000000)
    assert devfreq.parse_load("42") == (42.0, None)
    assert devfreq.parse_load("busy") is None
    assert accel.parse_permille("345\n") == 34.5
    assert accel.parse_permille("1001") is None and accel.parse_permille("x") is None


def test_rk3588_npu_and_gpu(tmp_path: Path) -> None:
    found = accel.read_accel_loads(build_tree(tmp_path, RK3588_TOP))
    by_name = {a.name: a for a in found}
    assert set(by_name) == {"rknpu", "fb000000.gpu"}  # dmc (memory clock) is neither
    npu = by_name["rknpu"]
    assert npu.kind == "npu" and npu.load_pct == (37.0, 0.0, 12.0) and npu.error is None
    assert npu.mean_load_pct == pytest.approx(49 / 3)
    gpu = by_name["fb000000.gpu"]
    assert gpu.load_pct == (9.0,) and gpu.cur_freq_hz == 300000000
    assert gpu.max_freq_hz == 1000000000


def test_jetson_gpu_permille(tmp_path: Path) -> None:
    (gpu,) = accel.read_accel_loads(build_tree(tmp_path, JETSON_TOP))
    assert (gpu.name, gpu.kind, gpu.load_pct) == ("17000000.gpu", "gpu", (34.5,))


def test_nothing_on_a_vm(tmp_path: Path) -> None:
    assert accel.read_accel_loads(tmp_path) == ()
    assert accel.read_accel_loads(THIS_MACHINE) == () or all(
        a.load_pct or a.error or a.cur_freq_hz for a in accel.read_accel_loads(THIS_MACHINE)
    )


def test_npu_present_but_debugfs_not_mounted(tmp_path: Path) -> None:
    tree = {k: v for k, v in RK3588_TOP.items() if "debug" not in k}
    npu = next(a for a in accel.read_accel_loads(build_tree(tmp_path, tree)) if a.kind == "npu")
    assert npu.name == "rknpu" and npu.load_pct == () and npu.error == "debugfs not mounted"


# ---------------------------------------------------------------- needs root, for real

# The tests run as root here, and root reads a mode-000 file: the unprivileged read
# is done in a child that drops to nobody (setuid), on a tree it can traverse.

CHILD = """
import json, os, sys
from pathlib import Path
from slmguard.host import accel, files, thermal
os.setgid(65534); os.setuid(65534)  # after the imports: the interpreter may live under /root
root = Path(sys.argv[1])
npu = [a.error for a in accel.read_accel_loads(root) if a.kind == "npu"]
zones = [z.error for z in thermal.read_thermal_zones(root)]
print(json.dumps({"npu": npu, "zones": zones,
                  "attr": files.read_attr(root / "sys/class/thermal/thermal_zone1/temp").error,
                  "probe": files.probe(root / "sys/kernel/debug/rknpu/load")}))
"""


def _unprivileged_tree() -> Path:
    base = Path(tempfile.mkdtemp(prefix="slmguard-top-noroot-"))
    base.chmod(0o755)
    root = build_tree(base / "root", RK3588_TOP)
    for dirpath, _dirs, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
    (root / "sys/kernel/debug").chmod(0o700)  # debugfs as the kernel mounts it
    (root / "sys/class/thermal/thermal_zone1/temp").chmod(0o600)
    return root


def test_unreadable_is_needs_root_not_zero() -> None:
    import json
    import shutil

    root = _unprivileged_tree()
    try:
        if os.geteuid() == 0:
            cmd = [sys.executable, "-c", CHILD, str(root)]
        else:
            cmd = [sys.executable, "-c", CHILD.replace("os.setgid(65534); os.setuid(65534)", ""),
                   str(root)]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent / "src"))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=False)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
    assert seen["npu"] == [files.NEEDS_ROOT]
    assert seen["zones"][1] == files.NEEDS_ROOT and seen["zones"][0] is None
    assert seen["attr"] == files.NEEDS_ROOT
    assert seen["probe"] == files.NEEDS_ROOT


def test_read_attr_outcomes(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("12\n")
    (tmp_path / "b").write_text("x")
    assert files.read_attr(tmp_path / "a").integer() == 12
    assert files.read_attr(tmp_path / "b").integer() is None
    absent = files.read_attr(tmp_path / "nope")
    assert absent.absent and absent.integer() is None
    assert files.read_attr(tmp_path / "a" / "below").absent  # ENOTDIR: not there
    directory = files.read_attr(tmp_path)
    assert directory.error and directory.error != files.NEEDS_ROOT  # EISDIR, said as such
    assert files.probe(tmp_path / "a") == "yes" and files.probe(tmp_path / "nope") == "no"
