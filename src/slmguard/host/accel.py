"""NPU and GPU load now, where the kernel shows it: Rockchip's rknpu, devfreq, Jetson's GPU.

Owns, under a root: **RKNPU** load, ``/sys/kernel/debug/rknpu/load`` (``NPU load:  Core0:
12%, Core1:   0%,`` on multi-core NPUs, driver 0.8+, or ``NPU load: 12%``; debugfs is root
only, and the NPU counts as present when ``/sys/module/rknpu``, the ``RKNPU`` platform
driver or a devfreq device named ``*npu*`` is); the NPU and GPU **devfreq** devices as
:mod:`slmguard.host.devfreq` reads them (clocks in Hz; Rockchip's BSP adds ``load``);
the **Jetson GPU**'s ``load`` in per mille (tegrastats' GR3D) under its
platform device (:data:`JETSON_GPU_LOADS`). Nothing found is an empty tuple; found but
unreadable carries ``error`` (``needs root``), never a 0. Not the device nodes
(:mod:`slmguard.host.devices`) nor the memory they hold (:mod:`slmguard.host.devmem`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from slmguard.host.devfreq import read_devfreq
from slmguard.host.files import NEEDS_ROOT, ROOT, read_attr

RKNPU_LOAD = "sys/kernel/debug/rknpu/load"
RKNPU_SIGNS = ("sys/module/rknpu", "sys/bus/platform/drivers/RKNPU")
# Nano, TX2, Xavier; L4T's platform name; Orin on L4T 35; Orin on L4T 36
JETSON_GPU_LOADS = (
    "sys/devices/gpu.0/load",
    "sys/devices/platform/gpu.0/load",
    "sys/devices/platform/17000000.ga10b/load",
    "sys/devices/platform/bus@0/17000000.gpu/load",
)
MAX_CORES = 16


@dataclass(frozen=True)
class AccelLoad:
    """One accelerator's load now. ``load_pct`` per core (one entry for a single core)."""

    name: str  # "rknpu", "fb000000.gpu", "gpu.0" ...
    kind: str  # "npu" | "gpu"
    source: str  # the file read, relative to the root
    load_pct: tuple[float, ...] = ()
    cur_freq_hz: int | None = None
    max_freq_hz: int | None = None
    error: str | None = None  # "needs root", or the read error

    @property
    def mean_load_pct(self) -> float | None:
        return sum(self.load_pct) / len(self.load_pct) if self.load_pct else None


# ---------------------------------------------------------------- pure parsers


def parse_rknpu_load(text: str) -> tuple[float, ...]:
    """Per-core percents from rknpu's ``load`` file; empty when it is not that format."""
    body = text.partition(":")[2] if "load" in text.lower() else ""
    cores = re.findall(r"Core\d+:\s*(\d+(?:\.\d+)?)%", body)
    if cores:
        return tuple(float(c) for c in cores[:MAX_CORES])
    single = re.match(r"\s*(\d+(?:\.\d+)?)%", body)
    return (float(single.group(1)),) if single else ()


def parse_permille(text: str) -> float | None:
    """Jetson's GPU ``load`` (0..1000) as a percent."""
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value / 10.0 if 0 <= value <= 1000 else None


# ---------------------------------------------------------------- readers


def _rknpu(root: Path, devfreq_names: list[str]) -> AccelLoad | None:
    attr = read_attr(root / RKNPU_LOAD)
    present = any((root / s).exists() for s in RKNPU_SIGNS) or any(
        "npu" in n for n in devfreq_names
    )
    if attr.absent and not present:
        return None
    if attr.text is not None:
        loads = parse_rknpu_load(attr.text)
        error = None if loads else f"unrecognised: {attr.text.strip()[:40]!r}"
        return AccelLoad("rknpu", "npu", RKNPU_LOAD, loads, error=error)
    # Present, but debugfs is not mounted or not ours to read.
    error = attr.error or (NEEDS_ROOT if _debugfs_closed(root) else "debugfs not mounted")
    return AccelLoad("rknpu", "npu", RKNPU_LOAD, error=error)


def _debugfs_closed(root: Path) -> bool:
    debugfs = root / "sys/kernel/debug"
    try:
        next(iter(debugfs.iterdir()), None)
    except PermissionError:
        return True
    except OSError:
        return False
    return False


def _devfreq(root: Path) -> list[AccelLoad]:
    """The NPU and GPU devfreq devices (:mod:`slmguard.host.devfreq`) as loads."""
    out = []
    for dev in read_devfreq(root):
        if dev.kind not in ("npu", "gpu"):
            continue
        out.append(
            AccelLoad(
                name=dev.name,
                kind=dev.kind,
                source=dev.source,
                load_pct=() if dev.load_pct is None else (dev.load_pct,),
                cur_freq_hz=dev.cur_hz,
                max_freq_hz=dev.max_hz,
                error=dev.error,
            )
        )
    return out


def _jetson_gpu(root: Path) -> AccelLoad | None:
    for rel in JETSON_GPU_LOADS:
        attr = read_attr(root / rel)
        if attr.absent:
            continue
        name = Path(rel).parent.name
        if attr.text is None:
            return AccelLoad(name, "gpu", rel, error=attr.error)
        pct = parse_permille(attr.text)
        if pct is None:
            return AccelLoad(name, "gpu", rel, error=f"unrecognised: {attr.text.strip()[:20]!r}")
        return AccelLoad(name, "gpu", rel, (pct,))
    return None


def read_accel_loads(root: Path = ROOT) -> tuple[AccelLoad, ...]:
    """Every NPU and GPU load source found under ``root`` (see the module docstring)."""
    devfreq = _devfreq(root)
    out: list[AccelLoad] = []
    npu = _rknpu(root, [d.name.lower() for d in devfreq])
    if npu is not None:
        out.append(npu)
    jetson = _jetson_gpu(root)
    if jetson is not None:
        out.append(jetson)
    # A devfreq NPU entry with no load of its own still tells the NPU clock.
    out.extend(devfreq)
    return tuple(out)
