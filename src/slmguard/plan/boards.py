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
from slmguard.host.procfs import ROOT, read_meminfo
from slmguard.plan.text import shown

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class BoardProfile:
    name: str
    title: str
    ram_bytes: int
    cpus: tuple[int, ...]
    big_cores: tuple[int, ...]
    isa: str  # key of slmguard.plan.budget.REPACK_RULES
    os_reserve_bytes: int
    business_reserve_bytes: int = 0
    npu_reserve_bytes: int = 0
    cma_bytes: int | None = None  # boot-time CMA pool to ask for; None = leave as is
    boot_file: str | None = None
    device_nodes: tuple[str, ...] = ()
    device_groups: tuple[str, ...] = ()
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


def _read_dt(root: Path, name: str) -> tuple[str, ...]:
    try:
        raw = (root / "proc/device-tree" / name).read_bytes()
    except OSError:
        return ()
    return tuple(s.strip() for s in raw.decode("utf-8", "replace").split("\x00") if s.strip())


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
    """The repack family (a key of ``budget.REPACK_RULES``) from /proc/cpuinfo (pure)."""
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


def detect_board(root: Path = ROOT) -> BoardProfile:
    """``--board auto``: a profile adjusted to what this host really has."""
    meminfo = read_meminfo(root)
    cpu: CpuFacts = read_cpu_facts(root)
    model_text = _read_dt(root, "model")
    model = model_text[0] if model_text else None
    family = family_from_device_tree(model, _read_dt(root, "compatible"))
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
        detected_from=f"{how}; MemTotal {meminfo.mem_total_bytes // MiB} MiB; "
        f"usable CPUs {','.join(map(str, usable))} (big cores by {signal}: "
        f"{','.join(map(str, big))}); quota {cpu.quota_cpus or 'none'}",
    )
