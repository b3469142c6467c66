"""host.zram and host.fstab: devices, the five boot services, swap lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostboards import JETSON, RK3588_HARDENED, RK3588_STOCK
from hosttree import Link, build_tree, copy_captured
from slmguard.errors import HostReadError
from slmguard.host import fstab, zram

WANTS = "etc/systemd/system/multi-user.target.wants"


def test_devices_stock_and_hardened(tmp_path: Path) -> None:
    stock = zram.read_zram_devices(build_tree(tmp_path / "s", RK3588_STOCK))
    assert len(stock) == 1
    dev = stock[0]
    assert dev.name == "zram0" and dev.active and dev.disksize_bytes == 4092928000
    assert dev.orig_data_bytes == 10485760 and dev.mem_used_bytes == 3145728
    assert dev.comp_algorithm == "zstd"
    assert zram.read_zram_devices(build_tree(tmp_path / "h", RK3588_HARDENED)) == ()
    assert len(zram.read_zram_devices(build_tree(tmp_path / "j", JETSON))) == 6


def test_device_captured_this_machine_is_inactive(tmp_path: Path) -> None:
    devices = zram.read_zram_devices(copy_captured("thismachine", tmp_path))
    assert [(d.name, d.active, d.comp_algorithm) for d in devices] == [("zram0", False, "lzo-rle")]


def test_device_garbled_and_short(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"sys/block/zram0/disksize": "big\n"})
    with pytest.raises(HostReadError, match="not an integer"):
        zram.read_zram_devices(root)
    assert zram.parse_mm_stat("123") == (None, None)


@pytest.mark.parametrize(
    ("name", "unit"),
    [
        ("zram-tools", "zramswap.service"),
        ("zram-config", "zram-config.service"),
        ("armbian-zram-config", "armbian-zram-config.service"),
        ("nvzramconfig", "nvzramconfig.service"),
    ],
)
@pytest.mark.parametrize("state", ["enabled", "disabled", "masked"])
def test_unit_services(tmp_path: Path, name: str, unit: str, state: str) -> None:
    tree: dict[str, str | Link | None] = {f"lib/systemd/system/{unit}": "[Unit]\n"}
    if state == "enabled":
        tree[f"{WANTS}/{unit}"] = Link(f"/lib/systemd/system/{unit}")
    if state == "masked":
        tree[f"{WANTS}/{unit}"] = Link(f"/lib/systemd/system/{unit}")
        tree[f"etc/systemd/system/{unit}"] = Link("/dev/null")
    (svc,) = zram.read_zram_services(build_tree(tmp_path, tree))
    assert svc.name == name
    assert svc.enabled is (state == "enabled")
    assert unit in svc.fix and state[:5] in svc.reason.replace("not enabled", "disabled")


def test_armbian_enabled_false_wins(tmp_path: Path) -> None:
    unit = "armbian-zram-config.service"
    tree = {
        f"lib/systemd/system/{unit}": "[Unit]\n",
        f"{WANTS}/{unit}": Link(f"/lib/systemd/system/{unit}"),
        "etc/default/armbian-zram-config": "ENABLED=false\n",
    }
    (svc,) = zram.read_zram_services(build_tree(tmp_path, tree))
    assert not svc.enabled and "ENABLED=false" in svc.reason


def test_board_services(tmp_path: Path) -> None:
    (stock,) = zram.read_zram_services(build_tree(tmp_path / "s", RK3588_STOCK))
    assert stock.enabled and "ENABLED=false" in stock.fix
    (hard,) = zram.read_zram_services(build_tree(tmp_path / "h", RK3588_HARDENED))
    assert not hard.enabled and "masked" in hard.reason
    (jet,) = zram.read_zram_services(build_tree(tmp_path / "j", JETSON))
    assert jet.name == "nvzramconfig" and jet.enabled


GEN = "usr/lib/systemd/system-generators/zram-generator"


@pytest.mark.parametrize(
    ("tree", "enabled", "reason"),
    [
        ({GEN: "", "usr/lib/systemd/zram-generator.conf": "[zram0]\n"}, True, "zram0"),
        (
            {
                GEN: "",
                "usr/lib/systemd/zram-generator.conf": "[zram0]\nzram-size = ram / 2\n",
                "etc/systemd/zram-generator.conf": "# no devices\n",
            },
            False,
            "no [zramN] section",
        ),
        ({GEN: ""}, False, "no zram-generator.conf"),
        (
            {
                GEN: "",
                "etc/systemd/zram-generator.conf": "",
                "etc/systemd/zram-generator.conf.d/10-x.conf": "[zram1]\n",
            },
            True,
            "zram1",
        ),
    ],
)
def test_zram_generator(tmp_path: Path, tree: dict[str, str], enabled: bool, reason: str) -> None:
    (svc,) = zram.read_zram_services(build_tree(tmp_path, tree))
    assert svc.name == "zram-generator" and svc.enabled is enabled and reason in svc.reason


def test_zram_generator_off_on_cmdline(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {GEN: "", "usr/lib/systemd/zram-generator.conf": "[zram0]\n"})
    (svc,) = zram.read_zram_services(root, ("quiet", "systemd.zram=0"))
    assert not svc.enabled and "systemd.zram=0" in svc.reason


def test_no_services(tmp_path: Path) -> None:
    assert zram.read_zram_services(tmp_path) == ()


def test_parse_env_file() -> None:
    env = zram.parse_env_file("# c\nENABLED='true' # on\nexport SWAP=\"false\"\nbroken\n")
    assert env == {"ENABLED": "true", "SWAP": "false"}


def test_fstab_swap_lines(tmp_path: Path) -> None:
    (line,) = fstab.read_fstab_swaps(build_tree(tmp_path / "s", RK3588_STOCK))
    assert line.lineno == 2 and line.spec == "/swapfile" and line.at_boot
    assert fstab.read_fstab_swaps(build_tree(tmp_path / "h", RK3588_HARDENED)) == ()
    assert fstab.read_fstab_swaps(tmp_path / "none") == ()
    parsed = fstab.parse_fstab_swaps(
        "# /dev/sda2 none swap sw 0 0\n/dev/sda3 none swap noauto 0 0\nbad\nUUID=1 none swap\n"
    )
    assert [(e.lineno, e.at_boot) for e in parsed] == [(2, False), (4, True)]


def test_fstab_captured_this_machine(tmp_path: Path) -> None:
    assert fstab.read_fstab_swaps(copy_captured("thismachine", tmp_path)) == ()


@pytest.mark.parametrize(
    ("line", "swap"),
    [
        ("/swapfile none swap sw 0 0", True),
        ("  UUID=1 none swap", True),  # indented, no options
        ("#/swapfile none swap sw 0 0", False),
        ("# /swapfile none swap sw 0 0", False),  # what the deployment writes
        ("/dev/sda1 / ext4 defaults 0 1", False),
        ("/swapfile none", False),
        ("", False),
    ],
)
def test_is_swap_entry(line: str, swap: bool) -> None:
    assert fstab.is_swap_entry(line) is swap
