"""The board's GPU as the kernel shows it: its nodes, who may open them, its driver and version.

Owns, under a root: the DRM render nodes ``/dev/dri/renderD*`` with the driver behind each
(``/sys/class/drm/<node>/device/uevent``, else its ``driver`` link; not every render node
is a GPU: :data:`GPU_DRM_DRIVERS` says which are), owner, group (``etc/group``) and mode;
the GPU's other nodes (Tegra's ``/dev/nvmap``, ``/dev/nvhost-*``, ``/dev/nvgpu/igpu0/*``;
Mali kbase's ``/dev/mali0``); the driver's version (the L4T release from
``/etc/nv_tegra_release``; kbase's DDK from ``/sys/module/*kbase/version`` and its GPU
from ``gpuinfo``; an in-tree DRM driver carries the kernel's ``osrelease``); and the
Vulkan ICD manifests of user space, so the doctor can tell a GPU Vulkan cannot reach.
Nodes are only listed and ``stat``-ed, never opened; a missing file is "not there".
Not the memory a GPU holds (:mod:`slmguard.host.devmem`) nor its load (``accel``).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from slmguard.host import files
from slmguard.host.files import ROOT, os_error_text

# DRM drivers whose render node is a GPU that runs compute (Vulkan), with what it drives.
GPU_DRM_DRIVERS = {
    "panthor": "Arm Mali CSF GPUs (Mali-G310/G610/G710: the RK3588's Mali-G610)",
    "panfrost": "Arm Mali Midgard/Bifrost/Valhall job-manager GPUs",
    "lima": "Arm Mali Utgard GPUs",
    "v3d": "Broadcom VideoCore VI/VII 3D (Raspberry Pi 4 and 5)",
    "msm": "Qualcomm Adreno",
    "etnaviv": "Vivante GPUs",
    "asahi": "Apple AGX",
    "powervr": "Imagination PowerVR",
    "amdgpu": "AMD GPUs",
    "i915": "Intel GPUs",
    "xe": "Intel Xe GPUs",
    "nouveau": "NVIDIA GPUs (open driver)",
    "virtio_gpu": "a virtual GPU",
}
# The Vulkan driver (ICD library) each GPU driver needs in user space.
VULKAN_LIBRARIES = {
    "panthor": "libvulkan_panfrost.so",
    "panfrost": "libvulkan_panfrost.so",
    "v3d": "libvulkan_broadcom.so",
    "mali_kbase": "libmali",
}
LAVAPIPE_LIBRARY = "libvulkan_lvp.so"  # Mesa's CPU Vulkan driver
L4T_RELEASE = "etc/nv_tegra_release"
ICD_DIRS = ("usr/share/vulkan/icd.d", "etc/vulkan/icd.d")
TEGRA_NODES = ("dev/nvmap", "dev/nvhost-*", "dev/nvgpu/igpu0/*")
MALI_NODE = "dev/mali0"
MAX_NODES = 64
MAX_ICDS = 32
MAX_TEXT = 64 << 10  # every file read here is a line or a small JSON manifest


@dataclass(frozen=True)
class DeviceNode:
    """One device node: its driver (render nodes), owner, group and mode, or why unknown."""

    path: str  # as the service sees it: /dev/dri/renderD128
    driver: str | None = None
    compatible: tuple[str, ...] = ()
    uid: int | None = None
    gid: int | None = None
    mode: int | None = None  # permission bits
    group: str | None = None  # the gid's name in etc/group
    problem: str | None = None  # why stat failed

    @property
    def is_gpu(self) -> bool:
        return self.driver in GPU_DRM_DRIVERS or self.driver == "mali_kbase"

    @property
    def others_rw(self) -> bool:
        return self.mode is not None and self.mode & 0o006 == 0o006

    def opens_for(self, groups: tuple[str, ...]) -> bool:
        """Whether a user in ``groups`` (not its owner) may open it read-write."""
        if self.others_rw:
            return True
        group_rw = self.mode is not None and self.mode & 0o060 == 0o060
        return group_rw and self.group is not None and self.group in groups

    @property
    def permissions(self) -> str:
        if self.mode is None:
            return self.problem or "unknown"
        owner = "root" if self.uid == 0 else str(self.uid)
        return f"{self.mode:04o} {owner}:{self.group or self.gid}"


@dataclass(frozen=True)
class GpuDriver:
    """A GPU driver found on the host and its version."""

    name: str  # "nvgpu", "mali_kbase", "panthor", "panfrost", "v3d", ...
    version: str | None
    source: str  # the file the version came from
    detail: str = ""  # the GPU it drives, where the kernel says


@dataclass(frozen=True)
class VulkanIcd:
    path: str
    library: str  # ICD.library_path
    api_version: str | None = None

    @property
    def is_lavapipe(self) -> bool:
        return Path(self.library).name.startswith(LAVAPIPE_LIBRARY.removesuffix(".so"))


@dataclass(frozen=True)
class GpuFacts:
    """Everything about the host's GPU the plan, doctor and render need."""

    render_nodes: tuple[DeviceNode, ...] = ()
    tegra_nodes: tuple[DeviceNode, ...] = ()
    mali_node: DeviceNode | None = None
    drivers: tuple[GpuDriver, ...] = ()
    vulkan_icds: tuple[VulkanIcd, ...] = ()
    l4t_release: str | None = None
    kernel_release: str | None = None

    def driver(self, name: str) -> GpuDriver | None:
        return next((d for d in self.drivers if d.name == name), None)

    @property
    def gpu_render_nodes(self) -> tuple[DeviceNode, ...]:
        return tuple(n for n in self.render_nodes if n.is_gpu)

    def nodes_for(self, backend: str) -> tuple[DeviceNode, ...]:
        """The nodes a service needs to open for ``backend`` (``cuda``, ``vulkan``)."""
        if backend == "cuda":
            return self.tegra_nodes
        if backend == "vulkan":
            mali = (self.mali_node,) if self.mali_node is not None else ()
            return self.gpu_render_nodes + mali
        return ()

    def vulkan_icd_for(self, driver: str) -> VulkanIcd | None:
        """The installed ICD that drives ``driver``'s GPU, if any."""
        want = VULKAN_LIBRARIES.get(driver)
        if want is None:
            return None
        stem = want.removesuffix(".so")
        return next((i for i in self.vulkan_icds if Path(i.library).name.startswith(stem)), None)


# ---------------------------------------------------------------- pure parsers


def parse_l4t_release(text: str) -> str | None:
    """``# R36 (release), REVISION: 4.0, GCID: ...`` -> ``R36.4.0`` (None: not that format)."""
    major = re.search(r"#\s*R(\d+)\s*\(release\)", text)
    if major is None:
        return None
    rev = re.search(r"REVISION:\s*(\d+(?:\.\d+)*)", text)
    return f"R{major.group(1)}" + (f".{rev.group(1)}" if rev else "")


def parse_uevent(text: str) -> tuple[str | None, tuple[str, ...]]:
    """(DRIVER, OF_COMPATIBLE_* in order) from a sysfs ``uevent`` file."""
    driver = None
    compatible: dict[int, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key == "DRIVER":
            driver = value.strip() or None
        elif (m := re.fullmatch(r"OF_COMPATIBLE_(\d{1,3})", key)) is not None:
            compatible[int(m.group(1))] = value.strip()
    return driver, tuple(compatible[i] for i in sorted(compatible))


def parse_group_file(text: str) -> dict[int, str]:
    """gid -> name from ``/etc/group`` lines (``name:x:gid:members``)."""
    out: dict[int, str] = {}
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) >= 3 and fields[2].isdigit() and fields[0]:
            out.setdefault(int(fields[2]), fields[0])
    return out


def parse_icd(text: str) -> tuple[str, str | None] | None:
    """(library_path, api_version) of a Vulkan ICD manifest; None when it is not one."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    icd = data.get("ICD") if isinstance(data, dict) else None
    if not isinstance(icd, dict) or not isinstance(icd.get("library_path"), str):
        return None
    api = icd.get("api_version")
    return icd["library_path"][:256], api[:32] if isinstance(api, str) else None


# ---------------------------------------------------------------- readers


def _small_text(path: Path) -> str | None:
    return files.read(path, MAX_TEXT).text


def _node(root: Path, path: Path, groups: dict[int, str], driver: str | None = None) -> DeviceNode:
    rel = "/" + str(path.relative_to(root))
    compatible: tuple[str, ...] = ()
    if driver is None and rel.startswith("/dev/dri/"):
        driver, compatible = _drm_driver(root, path.name)
    try:
        st = path.stat()
    except OSError as err:
        return DeviceNode(rel, driver, compatible, problem=os_error_text(err))
    return DeviceNode(
        rel,
        driver,
        compatible,
        st.st_uid,
        st.st_gid,
        stat.S_IMODE(st.st_mode),
        groups.get(st.st_gid),
    )


def _drm_driver(root: Path, name: str) -> tuple[str | None, tuple[str, ...]]:
    device = root / "sys/class/drm" / name / "device"
    text = _small_text(device / "uevent")
    driver, compatible = parse_uevent(text) if text is not None else (None, ())
    if driver is None:
        try:
            driver = Path(os.readlink(device / "driver")).name or None
        except OSError:
            driver = None
    return driver, compatible


def _glob_nodes(root: Path, pattern: str) -> list[Path]:
    try:
        return sorted(root.glob(pattern))[:MAX_NODES]
    except OSError:
        return []


def _mali_driver(root: Path) -> GpuDriver | None:
    """Arm's kbase: its module's DDK version and the GPU from gpuinfo."""
    modules = _glob_nodes(root, "sys/module/*kbase")
    gpuinfo = _small_text(root / "sys/class/misc/mali0/device/gpuinfo")
    if not modules and gpuinfo is None and not (root / MALI_NODE).exists():
        return None
    version = source = None
    for module in modules:
        text = _small_text(module / "version")
        if text is not None:
            version, source = text.strip()[:128], str(module.relative_to(root) / "version")
            break
    detail = (gpuinfo or "").strip()[:128]
    return GpuDriver("mali_kbase", version, source or "sys/module/*kbase/version", detail)


def _drm_drivers(root: Path, nodes: tuple[DeviceNode, ...], kernel: str | None) -> list[GpuDriver]:
    """In-tree DRM GPU drivers: their version is the kernel's."""
    out: list[GpuDriver] = []
    for name in dict.fromkeys(n.driver for n in nodes if n.driver in GPU_DRM_DRIVERS):
        assert name is not None
        out.append(GpuDriver(name, kernel, "proc/sys/kernel/osrelease", GPU_DRM_DRIVERS[name]))
    return out


def _icds(root: Path) -> tuple[VulkanIcd, ...]:
    out: list[VulkanIcd] = []
    for d in ICD_DIRS:
        for path in _glob_nodes(root, f"{d}/*.json")[:MAX_ICDS]:
            text = _small_text(path)
            parsed = parse_icd(text) if text is not None else None
            if parsed is not None:
                out.append(VulkanIcd("/" + str(path.relative_to(root)), *parsed))
    return tuple(out)


def read_gpu(root: Path = ROOT) -> GpuFacts:
    """The host's GPU facts under ``root`` (see the module docstring). Never raises for
    a missing or unreadable file: what could not be read is absent or carries ``problem``."""
    group_text = _small_text(root / "etc/group")
    groups = parse_group_file(group_text) if group_text is not None else {}
    render = tuple(_node(root, p, groups) for p in _glob_nodes(root, "dev/dri/renderD*"))
    tegra = tuple(
        _node(root, p, groups, "nvgpu") for pat in TEGRA_NODES for p in _glob_nodes(root, pat)
    )
    mali_path = root / MALI_NODE
    mali = _node(root, mali_path, groups, "mali_kbase") if mali_path.exists() else None
    l4t_text = _small_text(root / L4T_RELEASE)
    l4t = parse_l4t_release(l4t_text) if l4t_text is not None else None
    kernel_text = _small_text(root / "proc/sys/kernel/osrelease")
    kernel = kernel_text.strip()[:64] if kernel_text else None
    drivers = _drm_drivers(root, render, kernel)
    if l4t is not None or tegra:
        drivers.insert(0, GpuDriver("nvgpu", f"L4T {l4t}" if l4t else None, L4T_RELEASE))
    mali_driver = _mali_driver(root)
    if mali_driver is not None:
        drivers.append(mali_driver)
    return GpuFacts(render, tegra, mali, tuple(drivers), _icds(root), l4t, kernel)
