"""The node side of a Kubernetes/k3s board: kubelet settings from the plan, with their reasons.

Owns :func:`node_numbers` (pure arithmetic on the plan) and the two files a node of one
board kind needs: a ``KubeletConfiguration`` snippet and the k3s drop-in that loads it
(``kubelet-arg: config=...``, honoured over k3s's defaults from v1.32) and labels the
node with its board. With R the board's RAM, O the OS reserve, N the NPU/GPU reserve and
H the host-service neighbours: ``evictionHard`` ``memory.available`` = max(100 MiB,
O / 4); ``systemReserved`` = O - evictionHard + N + H, so Node Allocatable is what the
plan gives the pod and the business zone; no ``kubeReserved``; ``cpuManagerPolicy:
static`` with the CPUs outside the plan's affinity reserved; ``singleProcessOOMKill``
(the engine dies alone); ``failSwapOn``. ``docs/fleet.md`` gives each reason and the
figures per board.

It must not render the pods (:mod:`slmguard.deploy.fleet.k8s`) nor promise what a node
cannot hold: the kubelet sets ``vm.overcommit_memory=1``, so the plan's mode 2 does not
apply there.
"""

from __future__ import annotations

from dataclasses import dataclass

from slmguard.deploy.fleet import yamltext
from slmguard.deploy.fleet.kinds import BoardPlan
from slmguard.deploy.fleet.yamltext import Commented
from slmguard.deploy.units import cpu_list, neighbour_units
from slmguard.plan.schema import Plan

MiB = 1 << 20
#: The kubelet's default hard memory threshold, which k3s leaves out.
KUBELET_DEFAULT_EVICTION_BYTES = 100 * MiB
#: The kubelet's default file system thresholds (kubelet >= 1.31 has imagefs.inodesFree too);
#: an evictionHard map that leaves one out turns it off, so all are written.
KUBELET_DEFAULT_FS_EVICTION = {
    "nodefs.available": "10%",
    "nodefs.inodesFree": "5%",
    "imagefs.available": "15%",
    "imagefs.inodesFree": "5%",
}
#: evictionHard memory.available as a fraction of the OS reserve.
EVICTION_SHARE_OF_OS_RESERVE = 4  # one quarter
#: Where the rendered kubelet config goes on a k3s node.
K3S_KUBELET_CONFIG = "/etc/rancher/k3s/slmguard-kubelet.yaml"
K3S_DROPIN = "/etc/rancher/k3s/config.yaml.d/50-slmguard.yaml"
#: The node label the manifests select on.
BOARD_LABEL = "slmguard.io/board"
KUBELET_API = "kubelet.config.k8s.io/v1beta1"


@dataclass(frozen=True)
class NodeNumbers:
    """What one board kind's node reserves and gives the pod (bytes and CPU ids)."""

    eviction_bytes: int
    system_reserved_bytes: int
    allocatable_bytes: int  # R - systemReserved - evictionHard
    pod_memory_bytes: int  # request == limit: the plan's MemoryMax
    pod_cpus: int  # request == limit, whole CPUs
    reserved_cpus: tuple[int, ...]


def _mib_floor(n: int) -> int:
    return n // MiB * MiB


def host_neighbours_bytes(plan: Plan) -> int:
    """The memory of the plan's neighbours that run as host services (with a unit; each
    unit name checked as apply checks it, refused when it is not a service name)."""
    return sum(n.memory_bytes for _, n in neighbour_units(plan))


def node_numbers(bp: BoardPlan) -> NodeNumbers:
    """The node's reserves and the pod's resources for one board kind (see the docstring)."""
    plan = bp.plan
    os_reserve = plan.limits.os_reserve_bytes
    eviction = max(KUBELET_DEFAULT_EVICTION_BYTES, _mib_floor(os_reserve // 4))
    # NPU pool and the offloaded GPU buffers no cgroup sees (nvmap, kbase): kept from pods
    outside = plan.board.npu_reserve_bytes + plan.limits.device_bytes
    system = max(0, os_reserve - eviction) + outside + host_neighbours_bytes(plan)
    cpus = tuple(sorted(plan.board.cpus))
    pinned = tuple(sorted(plan.cpu_affinity))
    if pinned and len(pinned) < len(cpus):
        reserved = tuple(c for c in cpus if c not in pinned)
        pod_cpus = len(pinned)
    elif len(cpus) > 1:
        reserved, pod_cpus = cpus[:1], len(cpus) - 1
    else:
        reserved, pod_cpus = (), 1
    return NodeNumbers(
        eviction_bytes=eviction,
        system_reserved_bytes=system,
        allocatable_bytes=plan.board.ram_bytes - system - eviction,
        pod_memory_bytes=plan.limits.memory_max_bytes,
        pod_cpus=pod_cpus,
        reserved_cpus=reserved,
    )


def quantity(n_bytes: int) -> str:
    """Bytes as an exact Kubernetes quantity (``Gi``/``Mi``/``Ki`` when they divide it)."""
    for suffix, shift in (("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if n_bytes > 0 and n_bytes % (1 << shift) == 0:
            return f"{n_bytes >> shift}{suffix}"
    return str(n_bytes)


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB"


def _memory_reserve(n: NodeNumbers, plan: Plan) -> dict[str, object]:
    """evictionHard and systemReserved: the plan's OS reserve split between the two."""
    o, npu = plan.limits.os_reserve_bytes, plan.board.npu_reserve_bytes
    gpu = plan.limits.device_bytes
    gpu_text = f" + GPU buffers {_mib(gpu)}" if gpu else ""
    host = host_neighbours_bytes(plan)
    units = ", ".join(str(n.unit) for _, n in neighbour_units(plan))
    host_text = f" + the neighbours on the host ({units}) {_mib(host)}" if host else ""
    return {
        "evictionHard": Commented(
            {
                "memory.available": Commented(
                    quantity(n.eviction_bytes),
                    f"max(kubelet default 100 MiB, OS reserve {_mib(o)} / 4): the part of the "
                    "OS reserve that must stay free;\nbelow it the kubelet evicts pods "
                    "(Guaranteed last) before the kernel OOM killer has to.",
                ),
                **KUBELET_DEFAULT_FS_EVICTION,
            },
            "A threshold left out of evictionHard is 0 (off), not its default: the file "
            "system ones are the kubelet's defaults.",
        ),
        "systemReserved": {
            "memory": Commented(
                quantity(n.system_reserved_bytes),
                f"OS reserve {_mib(o)} - evictionHard {_mib(n.eviction_bytes)} + NPU/GPU "
                f"reserve {_mib(npu)}{gpu_text} (driver memory outside any cgroup)"
                f"{host_text}.\n"
                f"Node Allocatable = RAM {_mib(plan.board.ram_bytes)} - "
                f"{_mib(n.system_reserved_bytes)} - {_mib(n.eviction_bytes)} = "
                f"{_mib(n.allocatable_bytes)}: the inference pod "
                f"({_mib(n.pod_memory_bytes)}) and the business zone.\nNo kubeReserved: k3s "
                "runs the kubelet and containerd inside the OS reserve.",
            ),
        },
    }


def _exclusive_cpus(n: NodeNumbers, plan: Plan) -> dict[str, object]:
    """The static CPU manager and the CPUs kept from pods (none on a one-CPU board)."""
    if not n.reserved_cpus:
        return {}
    pinned = plan.cpu_affinity
    why = (
        f"the CPUs outside the plan's affinity {cpu_list(pinned)} (the big cores the "
        "engine runs on)"
        if pinned and len(pinned) < len(plan.board.cpus)
        else "one CPU for the OS, k3s and the business zone (the plan pins no cores)"
    )
    return {
        "cpuManagerPolicy": Commented(
            "static",
            f"The Guaranteed pod's {n.pod_cpus} whole CPUs become exclusive. Changing the "
            "policy on a node\nneeds `rm /var/lib/kubelet/cpu_manager_state` before the "
            "kubelet restarts.",
        ),
        "reservedSystemCPUs": Commented(cpu_list(n.reserved_cpus).replace(" ", ","), why),
    }


def kubelet_config(bp: BoardPlan) -> str:
    """The KubeletConfiguration for nodes of this board kind, each number with its reason."""
    n, plan = node_numbers(bp), bp.plan
    doc: dict[str, object] = {
        "apiVersion": KUBELET_API,
        "kind": "KubeletConfiguration",
        **_memory_reserve(n, plan),
        "enforceNodeAllocatable": ["pods"],
        "singleProcessOOMKill": Commented(
            True,
            "cgroup v2: without this the kubelet sets memory.oom.group and an OOM kill of "
            "the engine\nalso kills the front, which would otherwise restart the engine "
            "itself (kubelet >= 1.32).",
        ),
        "failSwapOn": Commented(True, "The plan turns swap off; a node with swap back is wrong."),
    }
    doc.update(_exclusive_cpus(n, plan))
    header = (
        f"kubelet settings for {bp.slug} nodes, from the slmguard plan.\n"
        f"k3s loads it through {K3S_DROPIN} (kubelet-arg config=...).\n"
        "Note: the kubelet sets vm.overcommit_memory=1 at start; the plan's overcommit "
        "mode does not hold on a node."
    )
    return yamltext.dump(doc, header)


def k3s_dropin(bp: BoardPlan) -> str:
    """The k3s config drop-in: load the kubelet config, label the node with its board."""
    doc = {
        "kubelet-arg": [f"config={K3S_KUBELET_CONFIG}"],
        "node-label": [f"{BOARD_LABEL}={bp.slug}"],
    }
    header = (
        f"k3s drop-in for {bp.slug} boards: copy to {K3S_DROPIN} and the kubelet config to "
        f"{K3S_KUBELET_CONFIG}, then restart k3s (or k3s-agent). Needs k3s v1.32 or later "
        "(older k3s passes --eviction-hard on the kubelet's command line, which wins over the "
        "file). node-label applies when the node registers; on a registered node: kubectl "
        f"label node NAME {BOARD_LABEL}={bp.slug}"
    )
    return yamltext.dump(doc, header)
