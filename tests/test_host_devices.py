"""host.devices and host.dmabuf: NPU/GPU nodes, RKNPU debugfs, DMA-BUF totals."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostboards import BUFINFO, JETSON, RK3588_HARDENED
from hosttree import build_tree
from slmguard.errors import HostReadError
from slmguard.host import devices, dmabuf


def test_rk3588_nodes_and_debugfs(tmp_path: Path) -> None:
    acc = devices.read_accelerator_nodes(build_tree(tmp_path, RK3588_HARDENED))
    assert acc.dri_render == ("/dev/dri/renderD128", "/dev/dri/renderD129")
    assert acc.rknpu_version == "RKNPU driver: v0.9.6" and acc.rknpu_debugfs_problem is None
    assert not acc.nvmap and acc.nvhost == ()


def test_jetson_nodes(tmp_path: Path) -> None:
    acc = devices.read_accelerator_nodes(build_tree(tmp_path, JETSON))
    assert acc.nvmap and "/dev/nvhost-gpu" in acc.nvhost
    assert "/dev/nvmap" in acc.all_nodes
    assert acc.rknpu_debugfs_problem is not None and "debugfs" in acc.rknpu_debugfs_problem


def test_rknpu_node_without_debugfs_driver_dir(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"dev/rknpu": "", "sys/kernel/debug/gpio": ""})
    acc = devices.read_accelerator_nodes(root)
    assert acc.rknpu == ("/dev/rknpu",)
    assert acc.rknpu_debugfs_problem is not None and "absent" in acc.rknpu_debugfs_problem


def test_rknpu_debugfs_unreadable(tmp_path: Path) -> None:
    # Root ignores file modes, so make version a directory to force a read error.
    root = build_tree(tmp_path, {"sys/kernel/debug/rknpu/version/x": ""})
    acc = devices.read_accelerator_nodes(root)
    assert acc.rknpu_version is None and acc.rknpu_debugfs_problem is not None


def test_bufinfo_total_line() -> None:
    assert dmabuf.parse_bufinfo(BUFINFO) == (2, 12582912)


def test_bufinfo_truncated_sums_rows() -> None:
    cut = BUFINFO[: BUFINFO.index("\nTotal 2 objects")]
    assert dmabuf.parse_bufinfo(cut) == (2, 12582912)


def test_bufinfo_garbage() -> None:
    with pytest.raises(ValueError):
        dmabuf.parse_bufinfo("hello\n")


def test_read_debugfs_then_sysfs(tmp_path: Path) -> None:
    totals = dmabuf.read_dmabuf_totals(build_tree(tmp_path / "a", RK3588_HARDENED))
    assert totals.count == 2 and totals.total_bytes == 12582912
    sysfs = build_tree(
        tmp_path / "b",
        {
            "sys/kernel/dmabuf/buffers/123/size": "8388608\n",
            "sys/kernel/dmabuf/buffers/124/size": "4096\n",
            "sys/kernel/dmabuf/buffers/124/exporter_name": "system\n",
        },
    )
    totals = dmabuf.read_dmabuf_totals(sysfs)
    assert (totals.count, totals.total_bytes) == (2, 8392704)
    assert totals.source == sysfs / dmabuf.SYSFS_BUFFERS


def test_sysfs_buffer_freed_during_the_walk_is_skipped(tmp_path: Path) -> None:
    root = build_tree(
        tmp_path,
        {
            "sys/kernel/dmabuf/buffers/123/size": "8388608\n",
            "sys/kernel/dmabuf/buffers/124": None,  # listed, then freed: no size any more
        },
    )
    totals = dmabuf.read_dmabuf_totals(root)
    assert (totals.count, totals.total_bytes) == (1, 8388608)
    bad = build_tree(tmp_path / "bad", {"sys/kernel/dmabuf/buffers/1/size": "big\n"})
    with pytest.raises(HostReadError, match="not an integer"):
        dmabuf.read_dmabuf_totals(bad)


def test_read_neither(tmp_path: Path) -> None:
    with pytest.raises(HostReadError, match="no /sys/kernel/dmabuf/buffers"):
        dmabuf.read_dmabuf_totals(tmp_path)
    bad = build_tree(tmp_path / "bad", {"sys/kernel/debug/dma_buf/bufinfo": "nothing\n"})
    with pytest.raises(HostReadError, match="no buffer table"):
        dmabuf.read_dmabuf_totals(bad)
