"""NPU/GPU device nodes: which accelerators the board exposes to a service.

Owns listing the nodes a deployment must allow (``DeviceAllow=``) and the RKNPU driver's
version from its debugfs directory:

    /dev/rknpu*                 Rockchip RKNPU (vendor kernels before 6.1 also use /dev/dri)
    /sys/kernel/debug/rknpu/    RKNPU driver state (version); needs root and debugfs
    /dev/dri/renderD*           DRM render nodes (Mali GPU, RKNPU on DRM, V3D on the Pi 5)
    /dev/nvhost-*, /dev/nvmap   NVIDIA Tegra (Jetson) GPU and memory manager
    /dev/dma_heap/*             DMA-BUF heaps (Linux >= 5.6: system, cma) used by NPU runtimes

Nodes are only listed, never opened. Not who may open a GPU node nor its driver
(:mod:`slmguard.host.gpu`), nor the load (:mod:`slmguard.host.accel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import files
from slmguard.host.files import ROOT

RKNPU_DEBUGFS = "sys/kernel/debug/rknpu"


@dataclass(frozen=True)
class AcceleratorNodes:
    rknpu: tuple[str, ...] = ()
    dri_render: tuple[str, ...] = ()
    nvhost: tuple[str, ...] = ()
    nvmap: bool = False
    dma_heaps: tuple[str, ...] = ()
    rknpu_version: str | None = None  # from debugfs, when readable
    rknpu_debugfs_problem: str | None = None  # why debugfs could not be read, if it could not

    @property
    def all_nodes(self) -> tuple[str, ...]:
        nodes = self.rknpu + self.dri_render + self.nvhost
        return nodes + (("/dev/nvmap",) if self.nvmap else ()) + self.dma_heaps


def _glob(root: Path, pattern: str) -> tuple[str, ...]:
    return tuple(sorted("/" + str(p.relative_to(root)) for p in root.glob(pattern)))


def _debugfs_problem(root: Path, got: files.FileRead) -> str | None:
    """Why the RKNPU version could not be read (None: it was)."""
    if got.data is not None:
        return None
    if got.needs_root:
        return f"/{RKNPU_DEBUGFS} needs root"
    if not got.absent:
        return f"/{RKNPU_DEBUGFS}: {got.error}"
    debugfs = root / "sys/kernel/debug"
    if not debugfs.is_dir() or not any(debugfs.iterdir()):
        return "debugfs not mounted or empty (mount -t debugfs none /sys/kernel/debug)"
    return f"/{RKNPU_DEBUGFS} absent (no RKNPU driver)"


def read_accelerator_nodes(root: Path = ROOT) -> AcceleratorNodes:
    """Device nodes under root/dev and the RKNPU debugfs version if readable."""
    got = files.read(root / RKNPU_DEBUGFS / "version")
    version = (got.text or "").strip()
    problem = _debugfs_problem(root, got)
    try:
        return AcceleratorNodes(
            rknpu=_glob(root, "dev/rknpu*"),
            dri_render=_glob(root, "dev/dri/renderD*"),
            nvhost=_glob(root, "dev/nvhost-*"),
            nvmap=(root / "dev/nvmap").exists() or (root / "dev/nvmap").is_symlink(),
            dma_heaps=_glob(root, "dev/dma_heap/*"),
            rknpu_version=version or None,
            rknpu_debugfs_problem=problem,
        )
    except OSError as err:
        raise HostReadError(root / "dev", err.strerror or str(err)) from err
