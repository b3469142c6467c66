"""One read of everything the doctor looks at, with the reason for anything unread.

Owns calling every host reader once under a root and keeping, for each fact, either its
value or an :class:`Unread` (the path and why it could not be read): nothing raises out
of :func:`collect` for a host problem (a missing debugfs, a permission error, a garbled
file), so each check can say ``unknown`` with the reason. It reads no file itself but the
plan a unit names, which is a plan (hostile until validated) and so goes through
:mod:`slmguard.regularfile`. The checks live in :mod:`slmguard.doctor` and never touch the
filesystem; nothing here decides what a fact means.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from slmguard import regularfile
from slmguard.errors import HostReadError, SlmguardError
from slmguard.host import (
    cgroup,
    devices,
    dmabuf,
    files,
    fstab,
    gpu,
    process,
    procfs,
    psi,
    storage,
    systemd,
    zram,
)
from slmguard.host.boardstate import BoardState, read_board_state
from slmguard.host.bootfiles import BootArgs, read_boot_args
from slmguard.host.filedigest import FileDigest, read_file_digest

log = logging.getLogger(__name__)

T = TypeVar("T")

SYSCTLS = ("vm.swappiness", "vm.overcommit_memory", "vm.overcommit_ratio", "vm.overcommit_kbytes")
DEFAULT_UNIT = "slmguard.service"
MAX_UNIT_PLAN_BYTES = 1 << 20  # a plan is a few KB; the plan reader's own cap is the same


@dataclass(frozen=True)
class PlanFile:
    """The raw bytes of a plan file a unit names (the doctor validates them)."""

    path: str
    raw: bytes


@dataclass(frozen=True)
class Unread:
    """A fact that could not be read: where from and why."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True)
class ServiceCommit:
    """What the running unit's processes hold of the commit charge (``Committed_AS``)."""

    unit: str
    cgroup_dir: Path
    processes: int
    committed_bytes: int


@dataclass(frozen=True)
class NeighbourUnit:
    """A neighbour's unit as the plan names it (issue 39): its file with drop-ins (None: not
    installed) and what a live systemd says of it (its slice, protection and memory)."""

    name: str
    unit: systemd.UnitFile | Unread | None
    effective: Mapping[str, str] | None = None


#: What ``systemctl show`` is asked of a neighbour's unit.
NEIGHBOUR_PROPERTIES = (
    "LoadState", "ActiveState", "Slice", "MemoryMin", "MemoryLow", "MemoryCurrent", "MemoryPeak",
)  # fmt: skip


@dataclass(frozen=True)
class HostSnapshot:
    root: Path
    euid: int
    meminfo: procfs.MemInfo | Unread
    swaps: tuple[procfs.SwapArea, ...] | Unread
    fstab_swaps: tuple[fstab.FstabSwap, ...] | Unread
    zram_devices: tuple[zram.ZramDevice, ...] | Unread
    zram_services: tuple[zram.ZramService, ...] | Unread
    swapfile_services: tuple[zram.ZramService, ...] | Unread
    sysctl: Mapping[str, int | Unread]
    cmdline: tuple[str, ...] | Unread
    boot_args: BootArgs | Unread | None  # None: no boot file found
    cgroup_layout: cgroup.CgroupLayout | Unread
    memlock: process.RLimit | Unread
    device_tree_model: str | Unread | None
    device_tree_compatible: tuple[str, ...] | Unread | None  # None: no device tree
    accelerators: devices.AcceleratorNodes | Unread
    dmabuf: dmabuf.DmaBufTotals | Unread
    pressure: psi.Pressure | Unread
    online_cpus: tuple[int, ...] | Unread
    big_cores: tuple[int, ...] | Unread  # fastest cores when they differ (big.LITTLE), else ()
    unit: systemd.UnitFile | Unread | None  # None: none asked for and none installed
    unit_effective: Mapping[str, str] | None = None  # systemctl show, live systemd only
    unit_plan: PlanFile | Unread | None = None  # the plan the unit's `slmguard serve --plan` reads
    service_commit: ServiceCommit | None = None  # None: the unit is not running
    gpu: gpu.GpuFacts | Unread | None = None  # None: not read (a snapshot built by hand)
    board: BoardState | Unread | None = None  # the board's tuning state; None: not read
    model_digest: FileDigest | Unread | None = None  # None: not asked (doctor --verify-model)
    # The plan's other files hashed (a board's models, the projector), each (its path, digest)
    file_digests: tuple[tuple[str, FileDigest | Unread], ...] = ()
    storage: storage.StorageFacts | Unread | None = None  # None: not read (built by hand)
    neighbours: tuple[NeighbourUnit, ...] = ()  # the units of a plan's neighbours, when given

    @property
    def unread(self) -> tuple[Unread, ...]:
        """Every fact that could not be read (for the 'could not see' list)."""
        out: list[Unread] = []
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, Unread):
                out.append(value)
            elif name == "sysctl":
                out.extend(v for v in value.values() if isinstance(v, Unread))
            elif name == "neighbours":
                out.extend(n.unit for n in value if isinstance(n.unit, Unread))
        return tuple(out)


def _try(default_path: str, fn: Callable[[], T]) -> T | Unread:
    """Run one reader; turn host problems into Unread instead of raising."""
    try:
        return fn()
    except SlmguardError as err:
        path = str(getattr(err, "path", default_path))
        return Unread(path, getattr(err, "problem", None) or err.message)
    except (OSError, ValueError, UnicodeDecodeError) as err:
        # Readers translate OS errors themselves; this is the last guard so that a
        # reader bug or an odd file never stops the whole audit.
        log.debug("reader for %s failed", default_path, exc_info=True)
        return Unread(default_path, f"{type(err).__name__}: {err}")


def _sysctl(root: Path, name: str) -> int | Unread:
    return _try(str(root / procfs.sysctl_path(name)), lambda: procfs.read_sysctl_int(root, name))


def _online_cpus(root: Path) -> tuple[int, ...]:
    text = files.read(root / "sys/devices/system/cpu/online").require()
    return systemd.parse_cpu_set(text)


def _big_cores(root: Path) -> tuple[int, ...]:
    from slmguard.host.cpu import read_cpu_facts

    facts = read_cpu_facts(root)
    big = facts.big_cores
    return big if set(big) != set(facts.online) else ()


def _unit(root: Path, unit: str | None) -> systemd.UnitFile | None:
    if unit is not None:
        return systemd.load_unit(root, unit)
    if systemd.find_unit(root, DEFAULT_UNIT) is None:
        return None
    return systemd.load_unit(root, DEFAULT_UNIT)


@dataclass(frozen=True)
class ServeModelArgs:
    """Which model an ``slmguard serve`` ExecStart= names: ``--plan`` and ``--model``
    (or ``SLMGUARD_PLAN`` / ``SLMGUARD_MODEL`` in Environment=; the flag wins)."""

    plan: str | None
    model: str | None
    where: str  # file:line of the ExecStart=


def _flag(argv: tuple[str, ...], name: str) -> str | None:
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def serve_model_args(unit: systemd.UnitFile) -> ServeModelArgs | None:
    """The unit's model arguments, or None when its ExecStart= is not ``slmguard serve``."""
    e = unit.entry("Service", "ExecStart")
    execs = unit.values("Service", "ExecStart")
    argv = systemd.exec_argv(execs[-1]) if execs else ()
    if e is None or len(argv) < 2 or Path(argv[0]).name != "slmguard" or "serve" not in argv:
        return None
    env = systemd.service_environment(unit)
    return ServeModelArgs(
        plan=_flag(argv, "--plan") or env.get("SLMGUARD_PLAN") or None,
        model=_flag(argv, "--model") or env.get("SLMGUARD_MODEL") or None,
        where=e.where,
    )


def _read_plan_file(path: Path) -> PlanFile:
    try:
        raw = regularfile.read_bounded(path, MAX_UNIT_PLAN_BYTES)
    except OSError as err:
        raise HostReadError(path, err.strerror or str(err)) from err
    if raw is None:
        raise HostReadError(path, f"larger than {MAX_UNIT_PLAN_BYTES >> 20} MiB, not a plan")
    return PlanFile(str(path), raw)


def _unit_plan(root: Path, unit: systemd.UnitFile | Unread | None) -> PlanFile | Unread | None:
    """The plan file the unit's serve command names, read under ``root`` (relative
    paths are relative to ``/``, systemd's default WorkingDirectory= for services)."""
    args = serve_model_args(unit) if isinstance(unit, systemd.UnitFile) else None
    if args is None or args.plan is None:
        return None
    path = root / args.plan.lstrip("/")
    return _try(str(path), lambda: _read_plan_file(path))


def _neighbour(root: Path, name: str) -> NeighbourUnit:
    """A neighbour's unit by name (never a path: the plan's names are unit names)."""
    if "/" in name or systemd.find_unit(root, name) is None:
        return NeighbourUnit(name, None)
    unit = _try(name, lambda: systemd.load_unit(root, name))
    return NeighbourUnit(name, unit, systemd.show_unit(name, root, NEIGHBOUR_PROPERTIES))


def _file_digest(root: Path, path: str) -> FileDigest | Unread:
    return _try(path, lambda: read_file_digest(root, path))


def collect(
    root: Path = files.ROOT,
    unit: str | None = None,
    boot_file: str | None = None,
    model_file: str | None = None,
    neighbour_units: tuple[str, ...] = (),
    other_files: tuple[str, ...] = (),
) -> HostSnapshot:
    """Read every fact under ``root``. ``unit`` is a unit name or file (default: slmguard.service
    when installed); ``boot_file`` overrides where ``cma=`` is looked for; ``model_file`` (a
    path on the target) is hashed whole (``doctor --verify-model``), and so is each of
    ``other_files`` (a board's other models, the projector); ``neighbour_units`` are the
    units of a plan's neighbours."""
    r = root
    cmdline = _try(str(r / "proc/cmdline"), lambda: procfs.read_cmdline(r))
    args = cmdline if isinstance(cmdline, tuple) else ()
    unit_file = _try(str(unit or DEFAULT_UNIT), lambda: _unit(r, unit))
    effective = None
    if isinstance(unit_file, systemd.UnitFile):
        effective = systemd.show_unit(unit_file.name, r)
    sysctl: dict[str, int | Unread] = {name: _sysctl(r, name) for name in SYSCTLS}
    return HostSnapshot(
        root=r,
        euid=os.geteuid(),
        meminfo=_try(str(r / "proc/meminfo"), lambda: procfs.read_meminfo(r)),
        swaps=_try(str(r / "proc/swaps"), lambda: procfs.read_swaps(r)),
        fstab_swaps=_try(str(r / fstab.FSTAB), lambda: fstab.read_fstab_swaps(r)),
        zram_devices=_try(str(r / "sys/block"), lambda: zram.read_zram_devices(r)),
        zram_services=_try(str(r / "etc/systemd"), lambda: zram.read_zram_services(r, args)),
        swapfile_services=_try(str(r / "etc/systemd"), lambda: zram.read_swapfile_services(r)),
        sysctl=sysctl,
        cmdline=cmdline,
        boot_args=_try(str(r / "boot"), lambda: read_boot_args(r, boot_file)),
        cgroup_layout=_try(str(r / "proc/self/mountinfo"), lambda: cgroup.read_layout(r)),
        memlock=_try(str(r / "proc/self/limits"), lambda: process.read_memlock_limit(r)),
        device_tree_model=_try(
            str(r / "proc/device-tree/model"), lambda: procfs.read_device_tree_model(r)
        ),
        device_tree_compatible=_try(
            str(r / "proc/device-tree/compatible"),
            lambda: procfs.read_device_tree_strings(r, "compatible") or None,
        ),
        accelerators=_try(str(r / "dev"), lambda: devices.read_accelerator_nodes(r)),
        dmabuf=_try(str(r / dmabuf.BUFINFO), lambda: dmabuf.read_dmabuf_totals(r)),
        pressure=_try(
            str(r / psi.PROC_PRESSURE_MEMORY),
            lambda: psi.read_pressure(r / psi.PROC_PRESSURE_MEMORY),
        ),
        online_cpus=_try(str(r / "sys/devices/system/cpu/online"), lambda: _online_cpus(r)),
        big_cores=_try(str(r / "sys/devices/system/cpu"), lambda: _big_cores(r)),
        unit=unit_file,
        unit_effective=effective,
        unit_plan=_unit_plan(r, unit_file),
        service_commit=_service_commit(r, unit_file),
        gpu=_try(str(r / "dev/dri"), lambda: gpu.read_gpu(r)),
        board=_try(str(r / "sys"), lambda: read_board_state(r)),
        model_digest=None
        if model_file is None
        else _try(model_file, lambda: read_file_digest(r, model_file)),
        file_digests=tuple((p, _file_digest(r, p)) for p in other_files),
        storage=_try(str(r / storage.MOUNTINFO), lambda: storage.read_storage(r)),
        neighbours=tuple(_neighbour(r, name) for name in neighbour_units),
    )


def _service_commit(root: Path, unit_file: object) -> ServiceCommit | None:
    """The commit charge of the unit's processes when it runs (its cgroup lists them)."""
    if not isinstance(unit_file, systemd.UnitFile):
        return None
    cgroup_dir = cgroup.unit_cgroup_dir(root, unit_file.name)
    if cgroup_dir is None:
        return None
    pids = cgroup.read_procs(cgroup_dir)
    charges = [c for c in (process.read_commit_bytes(root, pid) for pid in pids) if c is not None]
    if not charges:
        return None
    return ServiceCommit(unit_file.name, cgroup_dir, len(charges), sum(charges))
