"""The rendered unit of a GPU plan: exactly the GPU's nodes and groups, accepted by systemd.

Plans from the real planner for the three GPU boards (``--gpu`` their backend), rendered
and checked by ``systemd-analyze verify`` (see test_render_units.py), then hostile node
and group names in a GPU plan refused before anything is written.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from serveproc import default_model_path
from slmguard.deploy.render import RenderOptions, render_files
from slmguard.deploy.units import service_unit
from slmguard.errors import RefusedError
from slmguard.plan.boards import PROFILES
from slmguard.plan.inputs import PlanChoices, plan_for
from slmguard.plan.schema import Plan
from systemdunits import find_systemd_analyze
from systemdunits import materialize as _materialize
from systemdunits import values as _values
from systemdunits import verify as _verify

BOARDS = ("jetson-orin-nano-8g", "rk3588-8g", "rpi5-8g")
#: What each board's GPU plan lets the service open, and nothing else.
WANT = {
    "jetson-orin-nano-8g": [
        "/dev/nvmap rw", "/dev/nvhost-ctrl-gpu rw", "char-drm rw", "char-*.gpu rw",
    ],
    "rk3588-8g": ["char-drm rw", "char-dma_heap rw", "/dev/rknpu rw", "/dev/mali0 rw"],
    "rpi5-8g": ["char-drm rw"],
}  # fmt: skip


def _opts() -> RenderOptions:
    own = Path(sys.executable).parent / "slmguard"
    return RenderOptions(exec_path=str(own) if own.exists() else sys.executable)


def gpu_plan(board: str) -> Plan:
    model = default_model_path()
    if not model.is_file():
        pytest.skip(f"the default model is not prepared at {model} (make model)")
    gpu = PROFILES[board].gpu
    assert gpu is not None
    plan, _ = plan_for(
        Path("/"), model=model, board=board, ctx=None, choices=PlanChoices(gpu=gpu.backend)
    )
    assert plan.engine.n_gpu_layers > 0 and plan.engine.backend == gpu.backend
    return plan


@pytest.mark.parametrize("board", BOARDS)
def test_a_gpu_plans_unit_allows_the_gpu_nodes_and_groups(board: str) -> None:
    text = service_unit(gpu_plan(board), _opts())
    assert _values(text, "Service", "DevicePolicy") == ["closed"]
    assert _values(text, "Service", "DeviceAllow") == WANT[board]
    assert _values(text, "Service", "PrivateDevices") == []  # it would hide the GPU
    groups = _values(text, "Service", "SupplementaryGroups")
    assert len(groups) == 1 and set(groups[0].split()) == {"video", "render"}


@pytest.mark.parametrize("board", BOARDS)
def test_systemd_accepts_a_gpu_plans_units(board: str, tmp_path: Path) -> None:
    analyze = find_systemd_analyze()
    units = _materialize(render_files(gpu_plan(board), _opts()), tmp_path)
    assert _verify(analyze, units) == ""


@pytest.mark.parametrize(
    ("nodes", "groups", "needle"),
    [
        (("/dev/dri\nExecStartPre=/bin/sh",), ("render",), "not a path under /dev"),
        (("/dev/../etc/shadow",), ("render",), "not a path under /dev"),
        (("/dev/mali0 rwm",), ("render",), "not a path under /dev"),
        (("/dev/dri",), ("render\nUser=root",), "not a group name"),
        (("/dev/dri",), ("root video",), "not a group name"),
        (("/dev/dri",), ("-render",), "not a group name"),
    ],
)
def test_hostile_gpu_nodes_and_groups_are_refused(
    nodes: tuple[str, ...], groups: tuple[str, ...], needle: str
) -> None:
    plan = gpu_plan("rk3588-8g")
    hostile = replace(plan, board=replace(plan.board, device_nodes=nodes, device_groups=groups))
    with pytest.raises(RefusedError, match=needle):
        render_files(hostile, _opts())


def test_a_vulkan_plans_unit_keeps_the_engines_shader_cache_writable() -> None:
    """serve points Mesa's cache at <state dir>/shader-cache (serve.llamaserver); the unit
    must make that directory the transient user's to write, and say so. A CPU plan's unit
    says nothing of it."""
    from rendertrees import make_plan
    from slmguard.deploy import units
    from slmguard.serve import llamaserver

    cpu = make_plan()
    vulkan = replace(
        cpu,
        engine=replace(cpu.engine, n_gpu_layers=19, device="Vulkan0", backend="vulkan"),
    )
    text = service_unit(vulkan, _opts())
    assert units.SHADER_CACHE_DIR == llamaserver.SHADER_CACHE_DIR
    cache = f"{units.STATE_DIR}/{units.SHADER_CACHE_DIR}"
    assert f"# The Vulkan engine's compiled shaders persist in {cache}" in text.splitlines()
    assert _values(text, "Service", "StateDirectory") == ["slmguard"]  # writable, this user's
    env = " ".join(_values(text, "Service", "Environment"))
    assert f"SLMGUARD_STATE_DIR={units.STATE_DIR}" in env.split()
    assert "MESA_SHADER_CACHE" not in env  # serve sets it; the operator's would win
    assert _values(text, "Service", "MemoryDenyWriteExecute") == []  # LLVM's JIT (lavapipe)
    assert "shader" not in service_unit(cpu, _opts())
