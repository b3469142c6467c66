"""host.gpu and host.devmem on board trees: nodes, drivers, versions, device memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gputrees import LAVAPIPE_HOST, PANTHOR_FDINFO, RK3588_PANTHOR, V3D_FDINFO, engine_process
from hostboards import copy_board
from hosttree import build_tree
from slmguard.errors import HostReadError
from slmguard.host import devmem, dmabuf, gpu, procfs

MIB = 1 << 20
KIB = 1 << 10


def test_orin_nano_driver_nodes_and_release(tmp_path: Path) -> None:
    facts = gpu.read_gpu(copy_board("jetson-orin-nano-devkit", tmp_path))
    assert facts.l4t_release == "R36.4.0"
    nvgpu = facts.driver("nvgpu")
    assert nvgpu is not None and nvgpu.version == "L4T R36.4.0"
    cuda = [n.path for n in facts.nodes_for("cuda")]
    assert "/dev/nvmap" in cuda and "/dev/nvhost-ctrl-gpu" in cuda
    assert "/dev/nvgpu/igpu0/ctrl" in cuda
    # The render node is not the GPU CUDA uses: nothing for Vulkan here.
    assert facts.nodes_for("vulkan") == () and facts.kernel_release == "5.15.148-tegra"


def test_orin_nano_nvmap_meminfo_and_clients(tmp_path: Path) -> None:
    root = copy_board("jetson-orin-nano-devkit", tmp_path)
    mem = procfs.read_meminfo(root)
    assert mem.nvmap_used_bytes == 934912 * KIB and mem.nvmap_free_bytes == 12288 * KIB
    clients = devmem.read_nvmap_clients(root)
    assert clients is not None and clients.total_bytes == 934912 * KIB
    assert clients.pid_bytes(4242) == 742400 * KIB
    assert [c.process for c in clients.clients][-1] == "llama-server"


def test_orin_nano_bufinfo_nvmap_exports(tmp_path: Path) -> None:
    totals = dmabuf.read_dmabuf_totals(copy_board("jetson-orin-nano-devkit", tmp_path))
    assert (totals.count, totals.total_bytes) == (3, 2 * 8294400 + 2097152)


def test_rk3588_vendor_kernel_gpu_is_mali_kbase_not_a_render_node(tmp_path: Path) -> None:
    facts = gpu.read_gpu(copy_board("rk3588-rock5b", tmp_path))
    drivers = {n.path: n.driver for n in facts.render_nodes}
    assert drivers == {"/dev/dri/renderD128": "rockchip-drm", "/dev/dri/renderD129": "RKNPU"}
    assert facts.gpu_render_nodes == ()
    mali = facts.driver("mali_kbase")
    assert mali is not None and mali.version == "g29p0-00eac0 (UK version 1.36)"
    assert mali.detail == "Mali-G610 4 cores r0p0 0xA867"
    assert [n.path for n in facts.nodes_for("vulkan")] == ["/dev/mali0"]
    assert facts.vulkan_icd_for("mali_kbase") is None  # no libmali Vulkan ICD installed


def test_rk3588_mainline_panthor(tmp_path: Path) -> None:
    facts = gpu.read_gpu(build_tree(tmp_path, RK3588_PANTHOR))
    (node,) = facts.gpu_render_nodes
    assert node.path == "/dev/dri/renderD128" and node.driver == "panthor"
    assert node.compatible == ("rockchip,rk3588-mali", "arm,mali-valhall-csf")
    panthor = facts.driver("panthor")
    assert panthor is not None and panthor.version == "6.12.1-edge-rockchip-rk3588"
    icd = facts.vulkan_icd_for("panthor")
    assert icd is not None and icd.api_version == "1.4.305" and not icd.is_lavapipe


def test_pi5_v3d_render_node_and_permissions(tmp_path: Path) -> None:
    root = copy_board("rpi5", tmp_path)
    node_path = root / "dev/dri/renderD128"
    os.chown(node_path, 0, 105)
    node_path.chmod(0o660)
    facts = gpu.read_gpu(root)
    (node,) = facts.gpu_render_nodes
    assert (node.driver, node.compatible) == ("v3d", ("brcm,2712-v3d",))
    assert (node.mode, node.group, node.permissions) == (0o660, "render", "0660 root:render")
    assert node.opens_for(("render",)) and not node.opens_for(("video",))
    assert facts.vulkan_icd_for("v3d") is not None
    v3d = facts.driver("v3d")
    assert v3d is not None and v3d.version == "6.6.51+rpt-rpi-2712"


def test_world_writable_node_opens_for_anyone(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"dev/mali0": "", "etc/group": "video:x:44:\n"})
    (root / "dev/mali0").chmod(0o666)
    node = gpu.read_gpu(root).mali_node
    assert node is not None and node.others_rw and node.opens_for(())


def test_lavapipe_host_has_no_gpu_but_a_cpu_vulkan_driver(tmp_path: Path) -> None:
    facts = gpu.read_gpu(build_tree(tmp_path, LAVAPIPE_HOST))
    assert facts.render_nodes == () and facts.drivers == () and facts.mali_node is None
    (icd,) = facts.vulkan_icds
    assert icd.is_lavapipe


def test_empty_root_reads_nothing_and_raises_nothing(tmp_path: Path) -> None:
    facts = gpu.read_gpu(tmp_path)
    assert facts == gpu.GpuFacts()


def test_garbled_files_are_ignored(tmp_path: Path) -> None:
    root = build_tree(
        tmp_path,
        {
            "etc/nv_tegra_release": "not a release\n",
            "usr/share/vulkan/icd.d/x.json": "{not json",
            "usr/share/vulkan/icd.d/y.json": '{"ICD": {"library_path": 7}}',
            "etc/group": "::\nbad\nvideo:x:notanumber:\n",
            "dev/dri/renderD128": "",
            "sys/class/drm/renderD128/device/uevent": "garbage without equals\n",
        },
    )
    facts = gpu.read_gpu(root)
    assert facts.l4t_release is None and facts.vulkan_icds == ()
    (node,) = facts.render_nodes
    assert node.driver is None and node.group is None and not node.is_gpu


def test_render_node_driver_from_the_driver_symlink(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"dev/dri/renderD128": "", "sys/class/drm/renderD128/device": None})
    (root / "sys/class/drm/renderD128/device/driver").symlink_to(
        "../../../../bus/platform/drivers/v3d"
    )
    (node,) = gpu.read_gpu(root).render_nodes
    assert node.driver == "v3d"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("# R35 (release), REVISION: 5.0, GCID: 1", "R35.5.0"),
        ("# R32 (release), REVISION: 7.4", "R32.7.4"),
        ("# R36 (release)", "R36"),
        ("R36 REVISION 4.0", None),
    ],
)
def test_l4t_release(text: str, want: str | None) -> None:
    assert gpu.parse_l4t_release(text) == want


# ---------------------------------------------------------------- device memory


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("4096", 4096),
        ("412704 KiB", 412704 * KIB),
        ("612 MiB", 612 * MIB),
        ("742400K", 742400 * KIB),
        ("1 GiB", 1 << 30),
        ("12 Hz", None),
        ("-5", None),
        ("9" * 21, None),
    ],
)
def test_parse_size(text: str, want: int | None) -> None:
    assert devmem.parse_size(text) == want


def test_v3d_fdinfo() -> None:
    client = devmem.parse_drm_fdinfo(V3D_FDINFO)
    assert client is not None and (client.driver, client.client_id) == ("v3d", "17")
    (region,) = client.regions
    assert region.name == "memory" and region.total == 412704 * KIB
    assert region.resident == 401408 * KIB and client.held_bytes == 401408 * KIB
    assert client.charged_to_cgroup


def test_panthor_fdinfo_and_legacy_memory_key() -> None:
    client = devmem.parse_drm_fdinfo(PANTHOR_FDINFO)
    assert client is not None and client.held_bytes == 590 * MIB
    legacy = devmem.parse_drm_fdinfo("drm-driver:\tamdgpu\ndrm-memory-vram:\t1024 KiB\n")
    assert legacy is not None and legacy.regions[0].total == MIB and not legacy.charged_to_cgroup


def test_not_a_drm_fdinfo() -> None:
    assert devmem.parse_drm_fdinfo("pos:\t0\nflags:\t02\nsize:\t4096\nexp_name:\tsystem\n") is None


def test_nvmap_clients_truncated_and_garbled() -> None:
    text = "CLIENT PROCESS PID SIZE\nuser llama-server 7 100K\nuser x notapid 5K\n"
    clients = devmem.parse_nvmap_clients(text)
    assert clients.total_bytes == 100 * KIB and clients.pid_bytes(7) == 100 * KIB
    with pytest.raises(ValueError):
        devmem.parse_nvmap_clients("something else\n")


def test_engine_device_memory_pi5(tmp_path: Path) -> None:
    root = build_tree(tmp_path, engine_process(4242, V3D_FDINFO, dup_fds=3, dmabuf_bytes=MIB))
    mem = devmem.read_device_memory(root, 4242)
    assert mem is not None
    assert len(mem.drm) == 1  # three fds, one client
    assert mem.drm_bytes == 401408 * KIB and mem.dmabuf_bytes == MIB
    # v3d's buffers are shmem in the engine's cgroup; the DMA-BUF is not.
    assert mem.outside_cgroup_bytes == MIB
    assert mem.nvmap_bytes is None and mem.nvmap_system_bytes is None


def test_engine_device_memory_orin(tmp_path: Path) -> None:
    root = copy_board("jetson-orin-nano-devkit", tmp_path)
    build_tree(root, engine_process(4242, "pos:\t0\n", node="/dev/dri/renderD128"))
    mem = devmem.read_device_memory(root, 4242)
    assert mem is not None and mem.drm == ()
    assert mem.nvmap_bytes == 742400 * KIB and mem.nvmap_system_bytes == 934912 * KIB
    assert mem.outside_cgroup_bytes == 742400 * KIB


def test_the_callers_meminfo_is_used_not_read_again(tmp_path: Path) -> None:
    """The governor's sample has just read /proc/meminfo: its NvMapMemUsed is taken, the
    file is not read a second time (here it is not there at all, and no problem is said)."""
    root = copy_board("jetson-orin-nano-devkit", tmp_path)
    build_tree(root, engine_process(4242, "pos:\t0\n"))
    meminfo = procfs.read_meminfo(root)
    (root / "proc" / "meminfo").unlink()
    mem = devmem.read_device_memory(root, 4242, meminfo=meminfo)
    assert mem is not None and mem.problems == ()
    assert mem.nvmap_system_bytes == 934912 * KIB and mem.nvmap_bytes == 742400 * KIB
    alone = devmem.read_device_memory(root, 4242)
    assert alone is not None and alone.nvmap_system_bytes is None
    assert any("meminfo" in p for p in alone.problems)


def test_one_pass_over_a_live_process_with_many_fds(tmp_path: Path) -> None:
    """This process, with 300 more fds open: every fd counted, none a device fd here."""
    from slmguard.host import process

    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(300)]
    try:
        fds = process.read_device_fds(Path("/"), os.getpid(), max_fds=devmem.MAX_FDS)
        assert fds is not None and fds.fd_count >= 300
        assert fds.dmabuf_sizes == () and fds.drm_fdinfo == ()
        capped = process.read_device_fds(Path("/"), os.getpid(), max_fds=10)
        assert capped is not None and capped.fd_count == fds.fd_count  # counted, 10 looked at
    finally:
        for fd in held:
            os.close(fd)


def test_nvmap_unreadable_is_a_problem_not_a_zero(tmp_path: Path) -> None:
    root = build_tree(tmp_path, engine_process(7, PANTHOR_FDINFO))
    # A directory where the file should be: the read fails as a permission error would.
    (root / devmem.NVMAP_CLIENTS / "x").mkdir(parents=True)
    mem = devmem.read_device_memory(root, 7)
    assert mem is not None and mem.nvmap_bytes is None
    assert any("nvmap" in p for p in mem.problems)
    with pytest.raises(HostReadError):
        devmem.read_nvmap_clients(root)


def test_gone_process(tmp_path: Path) -> None:
    assert devmem.read_device_memory(tmp_path, 99) is None
