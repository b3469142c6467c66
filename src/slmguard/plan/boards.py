"""Board profiles and ``--board auto`` detection.

Owns the known target boards (RAM, CPU layout, the CPU's SIMD family for
weight repacking, reserves for the OS, the business-logic zone and the
NPU/GPU, where the boot arguments live) and detecting the host's board from
``/proc/device-tree/{model,compatible}``, ``/proc/meminfo`` and CPU capacity.

Reserves are policy, not measurement: ``os_reserve_bytes`` keeps the kernel,
sshd, journald and networking alive when the model misbehaves (the source
document's 4 GB example leaves about 1.2 GB outside MemoryMax=2800M);
``npu_reserve_bytes`` is memory the NPU/GPU driver takes outside any cgroup
(DMA-BUF, CMA); ``business_reserve_bytes`` is guaranteed (MemoryMin) to the
business-logic zone.

RAM in profiles is the nominal size; ``auto`` uses the kernel's MemTotal and
the CPUs this process may use (:mod:`slmguard.host.cpu`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import UsageError
from slmguard.host.cpu import CpuFacts, read_cpu_facts
from slmguard.host.cpufeatures import AARCH64, CpuFeatures, parse_cpuinfo, read_cpu_features
from slmguard.host.devmem import SHMEM_CHARGED_DRIVERS
from slmguard.host.gpu import GpuFacts, read_gpu
from slmguard.host.procfs import ROOT, read_device_tree_strings, read_meminfo
from slmguard.plan.text import shown

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class GpuProfile:
    """The board's GPU as llama.cpp uses it, and where its buffers are accounted.

    ``in_cgroup``: the driver charges the engine's device buffers to the engine's
    memory cgroup (shmem pages of drm_gem_shmem drivers, v3d and panthor; lavapipe's
    plain process memory); otherwise they are outside every cgroup (Jetson's nvmap,
    Mali kbase) and the plan moves MemoryMax down by them. ``process_memory``: the
    device allocations are the process's own anonymous memory (lavapipe): in its
    RSS and its commit charge. ``max_bytes``: the device's memory heap when it is
    smaller than the RAM (None: the board's RAM). ``max_tensor_bytes``: the largest
    tensor its buffers hold (Vulkan's ``maxStorageBufferRange``; larger ones stay in
    the CPU's buffers); None where not known (the boards' drivers: not measured here).
    """

    backend: str  # "vulkan" | "cuda": what llama-server must be built with
    device: str  # llama-server's --device name
    driver: str  # the kernel driver (host.gpu names): nvgpu, mali_kbase, panthor, v3d, lavapipe
    title: str
    in_cgroup: bool
    nodes: tuple[str, ...]  # what the service must open (DeviceAllow=)
    groups: tuple[str, ...] = ("video", "render")
    process_memory: bool = False
    max_bytes: int | None = None
    max_tensor_bytes: int | None = None  # Vulkan's maxStorageBufferRange where known
    note: str = ""


ORIN_GPU = GpuProfile(
    backend="cuda",
    device="CUDA0",
    driver="nvgpu",
    title="Ampere iGPU (CUDA through JetPack's nvgpu and nvmap)",
    in_cgroup=False,
    nodes=("/dev/nvmap", "/dev/nvhost-ctrl-gpu", "/dev/nvgpu"),
    groups=("video", "render"),
    note="a CUDA build of llama-server from JetPack (--llama-server PATH); cudaMalloc on "
    "Tegra takes pinned nvmap pages from the one DRAM, outside every cgroup; CUDA's own "
    "context and cuBLAS workspace are not measured here and stay in the GPU reserve",
)
RK3588_GPU = GpuProfile(
    backend="vulkan",
    device="Vulkan0",
    driver="mali_kbase",
    title="Mali-G610 MP4 (Vulkan: Arm's libmali on the vendor kernel's kbase)",
    in_cgroup=False,
    nodes=("/dev/mali0", "/dev/dri"),
    note="kbase pages are not charged to a cgroup; on a mainline kernel (panthor, Mesa's "
    "PanVK) they are shmem in the engine's cgroup: plan with --board auto there",
)
RPI5_GPU = GpuProfile(
    backend="vulkan",
    device="Vulkan0",
    driver="v3d",
    title="VideoCore VII (Vulkan: Mesa's v3dv)",
    in_cgroup=True,
    nodes=("/dev/dri",),
    note="v3d's buffers are shmem pages charged to the engine's cgroup",
)
LAVAPIPE_GPU = GpuProfile(
    backend="vulkan",
    device="Vulkan0",
    driver="lavapipe",
    title="lavapipe (Mesa's Vulkan on the CPU: no GPU, the measurement stand-in)",
    in_cgroup=True,
    nodes=(),
    groups=(),
    process_memory=True,
    max_bytes=2 * GiB,  # lavapipe's one memory heap (Mesa 22.3)
    max_tensor_bytes=128 * MiB,  # its maxStorageBufferRange (vulkaninfo)
    note="its device memory is the engine's own anonymous memory; llama.cpp uses a "
    "CPU-type Vulkan device only when GGML_VK_VISIBLE_DEVICES names it",
)


@dataclass(frozen=True)
class BoardProfile:
    name: str
    title: str
    ram_bytes: int
    cpus: tuple[int, ...]
    big_cores: tuple[int, ...]
    isa: str  # key of slmguard.plan.allocation.REPACK_RULES
    os_reserve_bytes: int
    business_reserve_bytes: int = 0
    npu_reserve_bytes: int = 0
    cma_bytes: int | None = None  # boot-time CMA pool to ask for; None = leave as is
    boot_file: str | None = None
    device_nodes: tuple[str, ...] = ()
    device_groups: tuple[str, ...] = ()
    gpu: GpuProfile | None = None  # None: no GPU llama.cpp can offload to
    max_threads: int | None = None  # cgroup CPU quota, when auto found one
    committed_bytes: int | None = None  # auto: Committed_AS when detected (the host's commit)
    detected_from: str = ""  # how auto found it (empty for a named profile)


def _rk3588(gib: int, os_mib: int, biz_mib: int, npu_mib: int) -> BoardProfile:
    return BoardProfile(
        name=f"rk3588-{gib}g",
        title=f"Rockchip RK3588 ({gib} GB)",
        ram_bytes=gib * GiB,
        cpus=tuple(range(8)),
        # cpu0-3 Cortex-A55 (capacity ~530), cpu4-7 Cortex-A76 (1024).
        big_cores=(4, 5, 6, 7),
        isa="arm_dotprod",
        os_reserve_bytes=os_mib * MiB,
        business_reserve_bytes=biz_mib * MiB,
        npu_reserve_bytes=npu_mib * MiB,
        cma_bytes=npu_mib * MiB,
        boot_file="/boot/armbianEnv.txt",
        device_nodes=("/dev/dri", "/dev/dma_heap", "/dev/rknpu"),
        device_groups=("render", "video"),
        gpu=RK3588_GPU,
    )


def _orin(gib: int, os_mib: int, biz_mib: int, gpu_mib: int) -> BoardProfile:
    return BoardProfile(
        name=f"jetson-orin-nano-{gib}g",
        title=f"NVIDIA Jetson Orin Nano ({gib} GB)",
        ram_bytes=gib * GiB,
        cpus=tuple(range(6)),  # 6x Cortex-A78AE, one cluster type
        big_cores=tuple(range(6)),
        isa="arm_dotprod",
        os_reserve_bytes=os_mib * MiB,
        business_reserve_bytes=biz_mib * MiB,
        npu_reserve_bytes=gpu_mib * MiB,
        cma_bytes=None,  # L4T manages GPU memory through nvmap, not a cma= pool
        boot_file="/boot/extlinux/extlinux.conf",
        device_nodes=("/dev/nvmap", "/dev/nvhost-ctrl-gpu", "/dev/dri"),
        device_groups=("video", "render"),
        gpu=ORIN_GPU,
    )


def _rpi5(gib: int, os_mib: int, biz_mib: int) -> BoardProfile:
    return BoardProfile(
        name=f"rpi5-{gib}g",
        title=f"Raspberry Pi 5 ({gib} GB)",
        ram_bytes=gib * GiB,
        cpus=(0, 1, 2, 3),  # 4x Cortex-A76
        big_cores=(0, 1, 2, 3),
        isa="arm_dotprod",
        os_reserve_bytes=os_mib * MiB,
        business_reserve_bytes=biz_mib * MiB,
        npu_reserve_bytes=64 * MiB,  # the display/camera pipeline's CMA (cma-64 default)
        cma_bytes=None,
        boot_file="/boot/firmware/cmdline.txt",
        device_nodes=("/dev/dri",),
        device_groups=("video", "render"),
        gpu=RPI5_GPU,
    )


PROFILES: Mapping[str, BoardProfile] = {
    p.name: p
    for p in (
        _rk3588(4, 512, 384, 256),
        _rk3588(8, 768, 1024, 512),
        _rk3588(16, 1024, 2048, 1024),
        _orin(4, 640, 384, 384),
        _orin(8, 768, 1024, 512),
        _rpi5(4, 512, 384),
        _rpi5(8, 768, 1024),
        BoardProfile(
            name="generic",
            title="generic Linux host (4 GB, 4 CPUs)",
            ram_bytes=4 * GiB,
            cpus=(0, 1, 2, 3),
            big_cores=(0, 1, 2, 3),
            isa="x86_avx2",
            os_reserve_bytes=512 * MiB,
        ),
    )
}

# device-tree "compatible" entries and the family they mean.
_COMPATIBLE = (
    ("rockchip,rk3588", "rk3588"),
    ("nvidia,tegra234", "jetson-orin-nano"),
    ("brcm,bcm2712", "rpi5"),
)
_MODEL_WORDS = (
    ("rk3588", "rk3588"),
    ("orin nano", "jetson-orin-nano"),
    ("raspberry pi 5", "rpi5"),
)


def board_names() -> tuple[str, ...]:
    return (*PROFILES, "auto")


def get_profile(name: str) -> BoardProfile:
    try:
        return PROFILES[name]
    except KeyError as err:
        raise UsageError(
            f"unknown board {shown(name)}",
            hint="choose one of: " + ", ".join(board_names()),
        ) from err


def family_from_device_tree(model: str | None, compatible: tuple[str, ...]) -> str | None:
    """The board family from device-tree strings (pure)."""
    for entry in compatible:
        for needle, family in _COMPATIBLE:
            if entry.lower().startswith(needle):
                return family
    low = (model or "").lower()
    for needle, family in _MODEL_WORDS:
        if needle in low:
            return family
    return None


def isa_from_cpuinfo(text: str) -> str:
    """The repack family (a key of ``allocation.REPACK_RULES``) from /proc/cpuinfo (pure)."""
    arch, features = parse_cpuinfo(text)
    return isa_from_features(CpuFeatures(arch or "unknown", features, "/proc/cpuinfo"))


def isa_from_features(cpu: CpuFeatures) -> str:
    """The repack family of the features every core has (``host.cpufeatures``).

    ``asimddp`` is the dot product (Armv8.2 Cortex-A55/A76/A78), ``i8mm`` the int8
    matrix multiply (Armv8.6); an arm64 CPU with neither (Cortex-A53/A72: Pi 3,
    Pi 4) gets no repacking, since a llama.cpp build that runs there has no
    dot-product kernels. Anything but arm64 is x86_avx2, as before.
    """
    if cpu.arch != AARCH64:
        return "x86_avx2"
    if "i8mm" in cpu.features:
        return "arm_i8mm"
    if "asimddp" in cpu.features:
        return "arm_dotprod"
    return "none"


def pick_variant(family: str, mem_total_bytes: int) -> BoardProfile:
    """The family's smallest profile whose nominal RAM holds ``mem_total_bytes``."""
    variants = sorted(
        (p for n, p in PROFILES.items() if n.startswith(family + "-")), key=lambda p: p.ram_bytes
    )
    for p in variants:
        if mem_total_bytes <= p.ram_bytes:
            return p
    return variants[-1]


_FAMILY_GPU = {"rk3588": RK3588_GPU, "jetson-orin-nano": ORIN_GPU, "rpi5": RPI5_GPU}


def _render_gpu(node: str, driver: str) -> GpuProfile:
    """A DRM GPU found on the host (panthor on a mainline RK3588, v3d, others)."""
    return GpuProfile(
        backend="vulkan",
        device="Vulkan0",
        driver=driver,
        title=f"{driver} GPU at {node} (Vulkan)",
        in_cgroup=driver in SHMEM_CHARGED_DRIVERS,
        nodes=(node,),
        note="found on this host"
        + (
            ": its buffers are shmem pages charged to the engine's cgroup"
            if driver in SHMEM_CHARGED_DRIVERS
            else ": its buffers are taken to be outside the engine's cgroup"
        ),
    )


def gpu_from_host(family: str | None, facts: GpuFacts) -> GpuProfile | None:
    """The GPU ``--board auto`` plans for: what the host's driver really is.

    Jetson: CUDA when the nvgpu nodes are there. A DRM GPU with its Vulkan driver
    installed (panthor, v3d, ...): that node. Arm's kbase (the RK3588 vendor kernel)
    with libmali's Vulkan driver: /dev/mali0. Without a Vulkan driver in user space a
    GPU is not planned for. Lavapipe alone is no GPU (``--gpu vulkan`` plans for it).
    """
    if facts.nodes_for("cuda") and (family == "jetson-orin-nano" or facts.l4t_release):
        return ORIN_GPU
    for node in facts.gpu_render_nodes:
        assert node.driver is not None
        if facts.vulkan_icd_for(node.driver) is not None:
            base = _FAMILY_GPU.get(family or "")
            if base is not None and base.driver == node.driver:
                return base
            return _render_gpu(node.path, node.driver)
    if facts.mali_node is not None and facts.vulkan_icd_for("mali_kbase") is not None:
        return (
            RK3588_GPU
            if family == "rk3588"
            else dataclasses.replace(RK3588_GPU, title="Mali GPU (Vulkan: Arm's libmali on kbase)")
        )
    return None


def lavapipe_gpu(facts: GpuFacts) -> GpuProfile | None:
    """Lavapipe as the GPU, where its Vulkan driver is installed (``--gpu vulkan`` here)."""
    return LAVAPIPE_GPU if any(i.is_lavapipe for i in facts.vulkan_icds) else None


def detect_board(root: Path = ROOT) -> BoardProfile:
    """``--board auto``: a profile adjusted to what this host really has."""
    meminfo = read_meminfo(root)
    cpu: CpuFacts = read_cpu_facts(root)
    model_text = read_device_tree_strings(root, "model")
    model = model_text[0] if model_text else None
    family = family_from_device_tree(model, read_device_tree_strings(root, "compatible"))
    if family is None:
        base = PROFILES["generic"]
        how = "no known device tree: generic profile"
        isa = isa_from_features(read_cpu_features(root))
        os_reserve = max(512 * MiB, meminfo.mem_total_bytes // 16)
        base = dataclasses.replace(
            base,
            isa=isa,
            os_reserve_bytes=os_reserve,
            title=f"this host ({model or 'no device-tree model'})",
        )
    else:
        base = pick_variant(family, meminfo.mem_total_bytes)
        how = f"device tree {model!r} -> {family}"
    gpu_facts = read_gpu(root)
    gpu = gpu_from_host(family, gpu_facts)
    usable = cpu.usable
    big = tuple(c for c in cpu.big_cores if c in usable) or usable
    signal = "cpu_capacity" if cpu.capacity else ("cpufreq" if cpu.max_freq_khz else "none")
    return dataclasses.replace(
        base,
        name=base.name if family else "generic",
        ram_bytes=meminfo.mem_total_bytes,
        cpus=cpu.online,
        big_cores=big,
        max_threads=cpu.usable_count,
        committed_bytes=meminfo.committed_as_bytes,
        gpu=gpu,
        detected_from=f"{how}; MemTotal {meminfo.mem_total_bytes // MiB} MiB; "
        f"GPU {gpu.driver + ' (' + gpu.backend + ')' if gpu else 'none'}; "
        f"usable CPUs {','.join(map(str, usable))} (big cores by {signal}: "
        f"{','.join(map(str, big))}); quota {cpu.quota_cpus or 'none'}",
    )
