"""doctor's GPU checks (gpu.nodes, gpu.driver) on captured board trees and offload plans."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from gputrees import LAVAPIPE_HOST, RK3588_PANTHOR
from hostboards import copy_board, plan_for_rk3588
from hosttree import build_tree
from slmguard import doctor
from slmguard.doctor.findings import Finding
from slmguard.host.snapshot import collect
from slmguard.plan.schema import BoardSpec, Plan

GIB = 1 << 30


def offload(plan: Plan, backend: str, nodes: tuple[str, ...], groups: tuple[str, ...]) -> Plan:
    """The plan with every layer of its model offloaded through ``backend``."""
    engine = dataclasses.replace(
        plan.engine,
        n_gpu_layers=plan.model.n_layer + 1,
        backend=backend,
        device="CUDA0" if backend == "cuda" else "Vulkan0",
    )
    board: BoardSpec = dataclasses.replace(plan.board, device_nodes=nodes, device_groups=groups)
    return dataclasses.replace(plan, engine=engine, board=board)


def gpu_findings(root: Path, plan: Plan | None) -> dict[str, Finding]:
    report = doctor.run_checks(collect(root), plan)
    return {f.id: f for f in report.findings if f.id.startswith("gpu.")}


def udev_modes(root: Path, nodes: dict[str, tuple[int, int]]) -> None:
    """Set nodes' group and mode as the board's udev rules would."""
    for rel, (gid, mode) in nodes.items():
        os.chown(root / rel, 0, gid)
        (root / rel).chmod(mode)


def test_no_plan_reports_what_is_there(tmp_path: Path) -> None:
    f = gpu_findings(copy_board("rpi5", tmp_path), None)
    assert (
        f["gpu.nodes"].severity == doctor.PASS and "/dev/dri/renderD128" in f["gpu.nodes"].summary
    )
    assert f["gpu.driver"].severity == doctor.PASS and "v3d" in f["gpu.driver"].summary


def test_pi5_offload_passes_with_render_group(tmp_path: Path) -> None:
    root = copy_board("rpi5", tmp_path)
    udev_modes(root, {"dev/dri/renderD128": (105, 0o660)})
    plan = offload(plan_for_rk3588(), "vulkan", ("/dev/dri",), ("video", "render"))
    f = gpu_findings(root, plan)
    assert f["gpu.nodes"].severity == doctor.PASS, f["gpu.nodes"].summary
    assert f["gpu.driver"].severity == doctor.PASS, f["gpu.driver"].summary


def test_pi5_node_the_service_cannot_open(tmp_path: Path) -> None:
    root = copy_board("rpi5", tmp_path)
    udev_modes(root, {"dev/dri/renderD128": (105, 0o660)})
    plan = offload(plan_for_rk3588(), "vulkan", ("/dev/dri",), ("video",))
    nodes = gpu_findings(root, plan)["gpu.nodes"]
    assert nodes.severity == doctor.FAIL
    assert "(video) cannot open /dev/dri/renderD128 (0660 root:render)" in nodes.summary


def test_node_outside_device_allow(tmp_path: Path) -> None:
    root = copy_board("rpi5", tmp_path)
    udev_modes(root, {"dev/dri/renderD128": (105, 0o666)})
    plan = offload(plan_for_rk3588(), "vulkan", ("/dev/dma_heap",), ("render",))
    nodes = gpu_findings(root, plan)["gpu.nodes"]
    assert nodes.severity == doctor.FAIL and "DeviceAllow=" in nodes.summary


def test_rk3588_vendor_kernel_without_libmali_vulkan(tmp_path: Path) -> None:
    root = copy_board("rk3588-rock5b", tmp_path)
    udev_modes(root, {"dev/mali0": (44, 0o660)})
    plan = offload(plan_for_rk3588(), "vulkan", ("/dev/mali0", "/dev/dri"), ("video",))
    f = gpu_findings(root, plan)
    assert f["gpu.nodes"].severity == doctor.PASS, f["gpu.nodes"].summary
    driver = f["gpu.driver"]
    assert driver.severity == doctor.FAIL and "mali_kbase" in driver.summary
    assert any("g29p0-00eac0" in e.value for e in driver.evidence)


def test_panthor_charges_the_cgroup_so_an_outside_budget_is_wrong(tmp_path: Path) -> None:
    root = build_tree(tmp_path, RK3588_PANTHOR)
    udev_modes(root, {"dev/dri/renderD128": (992, 0o660)})
    plan = offload(plan_for_rk3588(), "vulkan", ("/dev/dri",), ("render",))
    plan = dataclasses.replace(
        plan,
        limits=dataclasses.replace(plan.limits, device_bytes=GIB // 2),
    )
    driver = gpu_findings(root, plan)["gpu.driver"]
    assert driver.severity == doctor.WARN and "panthor keeps GPU buffers" in driver.summary


def test_orin_cuda(tmp_path: Path) -> None:
    root = copy_board("jetson-orin-nano-devkit", tmp_path)
    nodes = ("/dev/nvmap", "/dev/nvhost-ctrl-gpu", "/dev/nvgpu")
    udev_modes(root, {f"dev/{n}": (44, 0o660) for n in ("nvmap", "nvhost-ctrl-gpu")})
    udev_modes(
        root, {f"dev/nvgpu/igpu0/{n}": (44, 0o660) for n in ("ctrl", "as", "channel", "tsg")}
    )
    plan = offload(plan_for_rk3588(), "cuda", nodes, ("video",))
    f = gpu_findings(root, plan)
    assert f["gpu.nodes"].severity == doctor.PASS, f["gpu.nodes"].summary
    assert f["gpu.driver"].summary == "L4T R36.4.0: CUDA through nvgpu/nvmap"


def test_cuda_plan_on_a_board_without_l4t(tmp_path: Path) -> None:
    plan = offload(plan_for_rk3588(), "cuda", ("/dev/nvmap",), ("video",))
    f = gpu_findings(copy_board("rpi5", tmp_path), plan)
    assert (
        f["gpu.nodes"].severity == doctor.FAIL and "no nvmap/nvgpu node" in f["gpu.nodes"].summary
    )
    assert f["gpu.driver"].severity == doctor.FAIL


def test_lavapipe_only_is_a_warning(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {**LAVAPIPE_HOST, "dev/dri/renderD128": ""})
    plan = offload(plan_for_rk3588(), "vulkan", ("/dev/dri",), ())
    driver = gpu_findings(root, plan)["gpu.driver"]
    assert driver.severity == doctor.WARN and "lavapipe" in driver.summary
