"""Doctor checks on the GPU the plan offloads to: its nodes, their permissions, its driver.

Owns ``gpu.nodes`` (the nodes the plan's backend needs exist, the plan's
``board.device_nodes`` lets the unit reach them, and the service's groups,
``board.device_groups``, may open them) and ``gpu.driver`` (the GPU's driver and
its version, L4T release, Mali kbase DDK, panthor/v3d with the kernel; a Vulkan
driver in user space for that GPU rather than only Mesa's CPU one; the plan's
idea of where the device memory is charged against the driver's). Without a
plan, or for a CPU-only plan, they report what is there. Pure: reads only the
snapshot.
"""

from __future__ import annotations

from slmguard.doctor.devices import node_matches
from slmguard.doctor.findings import CheckId, Evidence, Finding, mib
from slmguard.host.devmem import SHMEM_CHARGED_DRIVERS
from slmguard.host.gpu import DeviceNode, GpuFacts
from slmguard.host.snapshot import HostSnapshot, Unread
from slmguard.plan.schema import Plan

_REPLAN = "or re-plan without the GPU: slmguard plan --gpu-layers 0"


def _offload(plan: Plan | None) -> tuple[str, int]:
    """(backend, layers) the plan offloads; ("cpu", 0) without a plan."""
    if plan is None:
        return "cpu", 0
    return plan.engine.backend, plan.engine.n_gpu_layers


def _node_evidence(g: GpuFacts, s: HostSnapshot) -> list[Evidence]:
    ev = [
        Evidence(n.path, f"{n.driver or 'driver unknown'}, {n.permissions}", str(s.root / "dev"))
        for n in (*g.render_nodes, *g.tegra_nodes, *((g.mali_node,) if g.mali_node else ()))
    ]
    return ev or [Evidence("GPU nodes", "none", str(s.root / "dev"))]


def _closed(nodes: tuple[DeviceNode, ...], plan: Plan) -> tuple[list[str], list[str]]:
    """(nodes the unit's DeviceAllow= leaves out, nodes the service's groups cannot open)."""
    allowed = plan.board.device_nodes
    groups = tuple(plan.board.device_groups)
    not_allowed = [n.path for n in nodes if not any(node_matches(a, n.path) for a in allowed)]
    unopenable = [f"{n.path} ({n.permissions})" for n in nodes if not n.opens_for(groups)]
    return not_allowed, unopenable


def _facts(s: HostSnapshot, check: CheckId) -> GpuFacts | Finding:
    """The snapshot's GPU facts, or the finding that says why there are none."""
    if isinstance(s.gpu, Unread):
        return check.unread(s.gpu)
    if s.gpu is None:
        return check.unknown("the GPU was not read")
    return s.gpu


def check_gpu_nodes(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("gpu.nodes", "GPU device nodes and their permissions")
    g = _facts(s, check)
    if isinstance(g, Finding):
        return g
    ev = _node_evidence(g, s)
    backend, layers = _offload(plan)
    if plan is None or not layers:
        found = [n.path for n in (*g.gpu_render_nodes, *g.nodes_for("cuda"))]
        found += [g.mali_node.path] if g.mali_node else []
        what = " ".join(found) if found else "no GPU nodes"
        return check.passed(what + ("" if plan is None else " (the plan does not offload)"), ev)
    nodes = g.nodes_for(backend)
    if not nodes:
        return check.fail(
            f"the plan offloads {layers} layers with {backend} but this host has no "
            f"{'nvmap/nvgpu' if backend == 'cuda' else 'GPU render or Mali'} node",
            ev,
            f"load the GPU's driver (the board's vendor kernel), {_REPLAN}",
        )
    not_allowed, unopenable = _closed(nodes, plan)
    if not_allowed:
        return check.fail(
            f"the plan's device nodes ({' '.join(plan.board.device_nodes) or 'none'}) leave "
            f"out {' '.join(not_allowed)}: the unit's DeviceAllow= will not let the engine "
            "open its GPU",
            ev,
            "re-plan on this board (slmguard plan --board auto) and re-render",
        )
    if unopenable:
        groups = " ".join(plan.board.device_groups) or "none"
        return check.fail(
            f"the service's groups ({groups}) cannot open {', '.join(unopenable)}",
            ev,
            "give the node to one of those groups (a udev rule: GROUP=, MODE=0660), "
            "or re-plan on this board",
        )
    return check.passed(f"{' '.join(n.path for n in nodes)} open for the service", ev)


def _driver_evidence(g: GpuFacts) -> list[Evidence]:
    ev = [
        Evidence(
            d.name, " ".join(x for x in (d.version or "version unknown", d.detail) if x), d.source
        )
        for d in g.drivers
    ]
    ev += [Evidence("Vulkan driver", i.library, i.path) for i in g.vulkan_icds]
    return ev or [Evidence("GPU driver", "none found", "/sys, /etc/nv_tegra_release")]


def _vulkan_driver(check: CheckId, g: GpuFacts, plan: Plan, ev: list[Evidence]) -> Finding:
    gpus = [d for d in g.drivers if d.name != "nvgpu"]
    with_icd = [d for d in gpus if g.vulkan_icd_for(d.name) is not None]
    lavapipe = any(i.is_lavapipe for i in g.vulkan_icds)
    if not with_icd:
        if lavapipe:
            return check.warn(
                "only Mesa's CPU Vulkan driver (lavapipe) is installed: the offloaded layers "
                "run on the CPU, in the engine's own memory",
                ev,
                "install the GPU's Vulkan driver (Mesa: mesa-vulkan-drivers), " + _REPLAN,
            )
        names = ", ".join(d.name for d in gpus) or "no GPU driver"
        return check.fail(
            f"the plan offloads with vulkan but no Vulkan driver serves {names}",
            ev,
            "install the GPU's Vulkan driver (Mesa's panfrost/broadcom ICD, or the vendor's "
            "libmali with Vulkan), " + _REPLAN,
        )
    driver = with_icd[0]
    charged = driver.name in SHMEM_CHARGED_DRIVERS
    outside = plan.limits.device_bytes
    if charged and outside:
        return check.warn(
            f"{driver.name} keeps GPU buffers in the engine's cgroup (shmem) but the plan put "
            f"{mib(outside)} of them outside it: MemoryMax is too low by that much",
            ev,
            "re-plan on this board: slmguard plan --board auto",
        )
    return check.passed(f"{driver.name} {driver.version or ''} with Vulkan".strip(), ev)


def check_gpu_driver(s: HostSnapshot, plan: Plan | None) -> Finding:
    check = CheckId("gpu.driver", "GPU driver and its version")
    g = _facts(s, check)
    if isinstance(g, Finding):
        return g
    ev = _driver_evidence(g)
    backend, layers = _offload(plan)
    if plan is None or not layers:
        found = ", ".join(f"{d.name} {d.version or ''}".strip() for d in g.drivers)
        return check.passed(found or "no GPU driver", ev)
    if backend == "cuda":
        nvgpu = g.driver("nvgpu")
        if g.l4t_release is None or nvgpu is None:
            return check.fail(
                "the plan offloads with cuda but this is not an L4T (Jetson) system: no "
                "/etc/nv_tegra_release",
                ev,
                "install JetPack, " + _REPLAN,
            )
        return check.passed(f"L4T {g.l4t_release}: CUDA through nvgpu/nvmap", ev)
    return _vulkan_driver(check, g, plan, ev)
