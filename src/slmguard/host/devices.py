"""NPU/GPU device nodes: which accelerators the board exposes to a service.

Owns listing the nodes a deployment must allow (``DeviceAllow=``) and the
driver's debug directory:

    /dev/rknpu*                 Rockchip RKNPU (vendor kernels before 6.1 also use /dev/dri)
    /sys/kernel/debug/rknpu/    RKNPU driver state (version, load); needs root and debugfs
    /dev/dri/renderD*           DRM render nodes (Mali GPU, RKNPU on DRM, V3D on the Pi 5)
    /dev/nvhost-*, /dev/nvmap   NVIDIA Tegra (Jetson) GPU and memory manager
    /dev/dma_heap/*             DMA-BUF heaps (Linux >= 5.6: system, cma) used by NPU runtimes

Existence is checked with ``os.path.lexists`` semantics on the fixture root;
nothing is opened except small debugfs text files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host.procfs import ROOT

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


def read_accelerators(root: Path = ROOT) -> AcceleratorNodes:
    """Device nodes under root/dev and the RKNPU debugfs version if readable."""
    version: str | None = None
    problem: str | None = None
    debug = root / RKNPU_DEBUGFS
    try:
        version = (debug / "version").read_text(encoding="utf-8", errors="replace").strip()
    except FileNotFoundError:
        if not (root / "sys/kernel/debug").is_dir() or not any(
            (root / "sys/kernel/debug").iterdir()
        ):
            problem = "debugfs not mounted or empty (mount -t debugfs none /sys/kernel/debug)"
        else:
            problem = f"/{RKNPU_DEBUGFS} absent (no RKNPU driver)"
    except PermissionError:
        problem = f"/{RKNPU_DEBUGFS} needs root"
    except OSError as err:
        problem = f"/{RKNPU_DEBUGFS}: {err.strerror or err}"
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
