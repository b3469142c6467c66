"""Board trees set up wrong: the captured boards with one tuning setting changed, as an
operator or a shipped image leaves it.

Each function takes the root of a tree copied by :func:`hostboards.copy_board` and
changes the files the kernel (or nvpmodel, or the Pi firmware driver) would show for
that setting, nothing else. The captured trees themselves are the boards set up right
(tests/fixtures/boards/README.md says where each file comes from).
"""

from __future__ import annotations

import shutil
from pathlib import Path

CPUFREQ = "sys/devices/system/cpu/cpufreq"
DEVFREQ = "sys/class/devfreq"
THERMAL = "sys/class/thermal"


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def cpu_governor(root: Path, policy: int, governor: str, *, cur_khz: int | None = None) -> None:
    """``echo GOVERNOR > policyN/scaling_governor``; ``powersave`` also drops the limits to
    the minimum, as the kernel's powersave governor does."""
    base = f"{CPUFREQ}/policy{policy}"
    write(root, f"{base}/scaling_governor", governor + "\n")
    low = (root / base / "cpuinfo_min_freq").read_text()
    if governor == "powersave":
        write(root, f"{base}/scaling_cur_freq", low)
    if cur_khz is not None:
        write(root, f"{base}/scaling_cur_freq", f"{cur_khz}\n")


def cpu_max(root: Path, policy: int, khz: int) -> None:
    """``echo KHZ > policyN/scaling_max_freq`` (a user or a tool capping the clock)."""
    write(root, f"{CPUFREQ}/policy{policy}/scaling_max_freq", f"{khz}\n")


def devfreq_set(
    root: Path, name: str, *, governor: str | None = None, max_hz: int | None = None
) -> None:
    """A devfreq device's governor or max_freq changed (powersave pins it to min_freq)."""
    base = root / DEVFREQ / name
    if governor is not None:
        (base / "governor").write_text(governor + "\n")
        if governor == "powersave":
            (base / "cur_freq").write_text((base / "min_freq").read_text())
    if max_hz is not None:
        (base / "max_freq").write_text(f"{max_hz}\n")


def without_dmc(root: Path) -> None:
    """An RK3588 whose device tree leaves the DMC disabled (or a bootloader without DDR
    scaling): no ``dmc`` devfreq device at all."""
    (root / DEVFREQ / "dmc").unlink()
    shutil.rmtree(root / "sys/devices/platform/dmc")


def zone_temp(root: Path, zone: int, millicelsius: int) -> None:
    write(root, f"{THERMAL}/thermal_zone{zone}/temp", f"{millicelsius}\n")


def pi_throttled(root: Path, value: int) -> None:
    """The Pi 5 firmware's get_throttled word, as the driver prints it (hex, no 0x)."""
    fw = "sys/devices/platform/soc@107c000000/soc@107c000000:firmware"
    write(root, f"{fw}/get_throttled", f"{value:x}\n")


def jetson_mode(root: Path, mode: int) -> None:
    """``sudo nvpmodel -m MODE`` on the Orin Nano tree: the status file, the cores the mode
    takes offline (7W: cpu4-5) and the CPU clock cap it writes to scaling_max_freq."""
    write(root, "var/lib/nvpmodel/status", f"pmode:{mode:04d} fmode:quiet\n")
    caps = {0: 1497600, 1: 1344000, 2: 1728000, 3: 960000}
    online = "0-3" if mode == 3 else "0-5"
    write(root, "sys/devices/system/cpu/online", online + "\n")
    for policy in (0, 4):
        cpu_max(root, policy, caps[mode])
    if mode == 3:
        for cpu in (4, 5):
            write(root, f"sys/devices/system/cpu/cpu{cpu}/online", "0\n")
