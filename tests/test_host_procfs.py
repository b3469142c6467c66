"""host.procfs: swaps, sysctl, cmdline cma=, device-tree model, meminfo edge cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostboards import JETSON, RK3588_HARDENED, RK3588_STOCK
from hosttree import build_tree, copy_captured
from slmguard.errors import HostReadError
from slmguard.host import kernelargs, procfs

MIB = 1024 * 1024


def test_swaps_stock_board(tmp_path: Path) -> None:
    root = build_tree(tmp_path, RK3588_STOCK)
    areas = procfs.read_swaps(root)
    assert [(a.filename, a.kind, a.is_zram) for a in areas] == [
        ("/dev/zram0", "partition", True),
        ("/swapfile", "file", False),
    ]
    assert areas[0].size_bytes == 3997000 * 1024 and areas[0].used_bytes == 10240 * 1024
    assert areas[1].priority == -2


def test_swaps_header_only_and_malformed() -> None:
    assert procfs.parse_swaps("Filename\tType\tSize\tUsed\tPriority\n") == ()
    text = "Filename Type Size Used Priority\n/dev/sda2 partition x 0 -2\n/a\\040b file 4 0 -3\n/x"
    assert [a.filename for a in procfs.parse_swaps(text)] == ["/a b"]


def test_swaps_missing_raises(tmp_path: Path) -> None:
    with pytest.raises(HostReadError, match="missing"):
        procfs.read_swaps(tmp_path)


def test_sysctl(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {**RK3588_HARDENED, "proc/sys/vm/overcommit_ratio": "eighty\n"})
    assert procfs.read_sysctl_int(root, "vm.swappiness") == 0
    assert procfs.read_sysctl(root, "vm.overcommit_memory") == "2"
    with pytest.raises(HostReadError, match="not an integer") as err:
        procfs.read_sysctl_int(root, "vm.overcommit_ratio")
    assert err.value.path == root / "proc/sys/vm/overcommit_ratio"
    with pytest.raises(HostReadError, match="missing"):
        procfs.read_sysctl_int(root, "vm.min_free_kbytes")


@pytest.mark.parametrize(
    ("cmdline", "cma"),
    [
        ("root=/dev/mmcblk0p2 cma=2048M rootwait", 2048 * MIB),
        ("cma=64M cma=256M@0-4G", 256 * MIB),  # the kernel honours the last
        ('root=x dyndbg="file a.c +p" cma=0x10000000', 0x10000000),
        ("root=x quiet", None),
    ],
)
def test_cma_from_cmdline(cmdline: str, cma: int | None) -> None:
    assert kernelargs.cma_bytes(procfs.parse_cmdline(cmdline)) == cma


def test_cma_garbage_raises() -> None:
    with pytest.raises(ValueError):
        kernelargs.cma_bytes(procfs.parse_cmdline("cma=lots"))


def test_cmdline_boards(tmp_path: Path) -> None:
    root = build_tree(tmp_path, RK3588_HARDENED)
    args = procfs.read_cmdline(root)
    assert "rootwait" in args and kernelargs.arg_value(args, "cma") == "2048M"


def test_device_tree_model(tmp_path: Path) -> None:
    assert procfs.read_device_tree_model(build_tree(tmp_path / "a", JETSON)) == (
        "NVIDIA Jetson Orin Nano Developer Kit"
    )
    assert procfs.read_device_tree_model(build_tree(tmp_path / "b", {})) is None


def test_meminfo_captured(tmp_path: Path) -> None:
    root = copy_captured("thismachine", tmp_path)
    mem = procfs.read_meminfo(root)
    assert mem.mem_total_bytes > 0 and mem.mem_available_bytes is not None
    assert mem.commit_headroom_bytes is not None


def test_meminfo_truncated_and_malformed(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"proc/meminfo": "MemFree:  100 kB\nMemAvailable: lots kB\n"})
    with pytest.raises(HostReadError, match="no MemTotal"):
        procfs.read_meminfo(root)
    cut = procfs.parse_meminfo("MemTotal: 1000 kB\nMemAvailable: 500 kB\nCommitLim")
    assert cut.mem_available_bytes == 500 * 1024 and cut.commit_headroom_bytes is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("MemTotal: 4000 kB\nHugetlb:  2048 kB\nHugePages_Total: 9\n", 2048 * 1024),
        ("MemTotal: 4000 kB\nHugePages_Total:       4\nHugepagesize:       2048 kB\n", 8 * MIB),
        ("MemTotal: 4000 kB\nHugePages_Total: 4\n", 0),  # no size: nothing to multiply
        ("MemTotal: 4000 kB\n", 0),  # no CONFIG_HUGETLBFS: none reserved
    ],
)
def test_meminfo_huge_pages(text: str, expected: int) -> None:
    assert procfs.parse_meminfo(text).hugetlb_bytes == expected


def test_meminfo_huge_pages_captured(tmp_path: Path) -> None:
    # This machine's meminfo (Linux 6.x) prints Hugetlb: 0 kB and 0 default pages.
    mem = procfs.read_meminfo(copy_captured("thismachine", tmp_path))
    assert mem.hugetlb_all_sizes_bytes == 0 and mem.hugepages_total == 0
    assert mem.hugepage_size_bytes == 2 * MIB and mem.hugetlb_bytes == 0


def test_uptime_is_read_from_the_root(tmp_path: Path) -> None:
    from slmguard.host.procfs import read_uptime_s

    (tmp_path / "proc").mkdir()
    assert read_uptime_s(tmp_path) is None  # no clock in a bare fixture tree
    (tmp_path / "proc/uptime").write_text("garbage\n")
    assert read_uptime_s(tmp_path) is None
    (tmp_path / "proc/uptime").write_text("12345.67 2345.00\n")
    assert read_uptime_s(tmp_path) == 12345.67
    live = read_uptime_s(Path("/"))
    assert live is not None and live > 0
