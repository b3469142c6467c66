"""zram: the devices that exist now and the services that recreate them (and swap files) at boot.

Owns reading ``/sys/block/zram*`` (Documentation/admin-guide/blockdev/zram.rst) and
recognising the five ways distributions set zram up at boot (:data:`ZRAM_UNITS` and
zram-generator; the table above them says which distribution uses which), and Raspberry
Pi OS's ``dphys-swapfile.service``, which makes a swap file at boot
(:func:`read_swapfile_services`). Whether a unit is installed, enabled or masked is
:mod:`slmguard.host.systemd`'s to say. Nothing here writes; the fix strings are for the
doctor to print.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import files
from slmguard.host.files import ROOT
from slmguard.host.systemd import find_unit_file, unit_enabled_links, unit_masked

GENERATOR_PATHS = (
    "usr/lib/systemd/system-generators/zram-generator",
    "lib/systemd/system-generators/zram-generator",
)
# The first one found wins (zram-generator.conf(5)); drop-ins add to it.
GENERATOR_CONFIGS = (
    "run/systemd/zram-generator.conf",
    "etc/systemd/zram-generator.conf",
    "usr/local/lib/systemd/zram-generator.conf",
    "usr/lib/systemd/zram-generator.conf",
    "lib/systemd/zram-generator.conf",
)
GENERATOR_DROPIN_DIRS = tuple(c + ".d" for c in GENERATOR_CONFIGS)

ARMBIAN_DEFAULTS = "etc/default/armbian-zram-config"

#   service               unit / file                                    distribution
#   zram-tools            zramswap.service, /etc/default/zramswap        Debian, Armbian (some)
#   zram-config           zram-config.service                            Ubuntu
#   armbian-zram-config   armbian-zram-config.service,                   Armbian
#                         /etc/default/armbian-zram-config (ENABLED=)
#   nvzramconfig          nvzramconfig.service                           NVIDIA L4T (Jetson)
#   zram-generator        /usr/lib/systemd/system-generators/zram-generator,
#                         zram-generator.conf with a [zramN] section     Fedora, Debian >= 12
#
# service name -> its systemd unit
ZRAM_UNITS = {
    "zram-tools": "zramswap.service",
    "zram-config": "zram-config.service",
    "armbian-zram-config": "armbian-zram-config.service",
    "nvzramconfig": "nvzramconfig.service",
}

# service name -> its unit, for services that create a swap file (not zram) at boot
SWAPFILE_UNITS = {"dphys-swapfile": "dphys-swapfile.service"}


@dataclass(frozen=True)
class ZramDevice:
    """One /sys/block/zramN device. ``disksize_bytes`` 0 means not set up (no memory used)."""

    name: str
    disksize_bytes: int
    orig_data_bytes: int | None = None  # mm_stat column 1: uncompressed data stored
    mem_used_bytes: int | None = None  # mm_stat column 3: RAM the device uses now
    comp_algorithm: str | None = None

    @property
    def active(self) -> bool:
        return self.disksize_bytes > 0


@dataclass(frozen=True)
class ZramService:
    """A boot-time zram service found under the root."""

    name: str  # key of ZRAM_UNITS or "zram-generator"
    path: Path  # the unit file or generator config that was read
    enabled: bool  # will create zram at next boot
    reason: str  # why enabled/disabled, for the evidence column
    fix: str  # the command that stops it coming back


def parse_mm_stat(text: str) -> tuple[int | None, int | None]:
    """(orig_data_size, mem_used_total) from zram mm_stat (Linux >= 4.1), Nones if short."""
    cols = text.split()
    try:
        return int(cols[0]), int(cols[2])
    except (IndexError, ValueError):
        return None, None


def parse_selected(text: str) -> str | None:
    """The bracketed choice of a sysfs list such as ``lzo [lz4] zstd``."""
    m = re.search(r"\[([^\]]+)\]", text)
    return m.group(1) if m else (text.strip() or None)


def read_zram_devices(root: Path = ROOT) -> tuple[ZramDevice, ...]:
    """Every /sys/block/zram* device; an empty tuple when the module is not loaded."""
    block = root / "sys/block"
    out: list[ZramDevice] = []
    try:
        names = sorted(p.name for p in block.iterdir() if p.name.startswith("zram"))
    except FileNotFoundError:
        return ()
    except OSError as err:
        raise HostReadError(block, err.strerror or str(err)) from err
    for name in names:
        rel = f"sys/block/{name}"
        text = files.read(root / rel / "disksize").require().strip()
        try:
            disksize = int(text)
        except ValueError as err:
            raise HostReadError(root / rel / "disksize", f"not an integer: {text!r}") from err
        mm_stat = files.read(root / rel / "mm_stat").optional()
        orig, used = parse_mm_stat(mm_stat) if mm_stat is not None else (None, None)
        algorithms = files.read(root / rel / "comp_algorithm").optional()
        algo = parse_selected(algorithms) if algorithms is not None else None
        out.append(ZramDevice(name, disksize, orig, used, algo))
    return tuple(out)


def parse_env_file(text: str) -> dict[str, str]:
    """``KEY=value`` shell assignments (comments, quotes stripped); enough for /etc/default."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.split(" #", 1)[0].strip().strip("'\"")
        out[key.strip().removeprefix("export ").strip()] = value
    return out


def generator_sections(text: str) -> tuple[str, ...]:
    """The ``[zramN]`` sections of a zram-generator config."""
    return tuple(
        m.group(1) for m in re.finditer(r"^\s*\[(zram\d+)\]\s*$", text, flags=re.MULTILINE)
    )


def _unit_service(root: Path, name: str, unit: str) -> ZramService | None:
    path = find_unit_file(root, unit)
    if path is None:
        return None
    fix = f"systemctl disable --now {unit} && systemctl mask {unit}"
    if unit_masked(root, unit):
        return ZramService(name, path, False, f"{unit} is masked", fix)
    links = unit_enabled_links(root, unit)
    if not links:
        return ZramService(name, path, False, f"{unit} is installed but not enabled", fix)
    where = str(links[0].relative_to(root))
    armbian = name == "armbian-zram-config"
    defaults = files.read(root / ARMBIAN_DEFAULTS).optional() if armbian else None
    if defaults is not None:
        env = parse_env_file(defaults)
        if env.get("ENABLED", "").lower() == "false":
            return ZramService(
                name, root / ARMBIAN_DEFAULTS, False, "ENABLED=false in " + ARMBIAN_DEFAULTS, fix
            )
        fix = (
            f"set ENABLED=false in /{ARMBIAN_DEFAULTS} "
            f"(and: systemctl disable --now {unit} && systemctl mask {unit})"
        )
    return ZramService(name, path, True, f"{unit} enabled ({where})", fix)


def _generator_service(root: Path, cmdline: tuple[str, ...]) -> ZramService | None:
    generator = next((root / p for p in GENERATOR_PATHS if (root / p).exists()), None)
    if generator is None:
        return None
    fix = (
        "create an empty /etc/systemd/zram-generator.conf "
        "(and remove zram-generator.conf.d drop-ins)"
    )
    if "systemd.zram=0" in cmdline:
        return ZramService(
            "zram-generator", generator, False, "systemd.zram=0 on the kernel command line", fix
        )
    sections: list[str] = []
    main = next((root / c for c in GENERATOR_CONFIGS if (root / c).exists()), None)
    read_from = [main] if main else []
    for d in GENERATOR_DROPIN_DIRS:
        if (root / d).is_dir():
            read_from.extend(sorted((root / d).glob("*.conf")))
    for path in read_from:
        if path.is_symlink() and str(path.readlink()) == "/dev/null":
            continue
        sections.extend(generator_sections(files.read(path).require()))
    if not sections:
        what = str(main.relative_to(root)) if main else "no zram-generator.conf"
        return ZramService(
            "zram-generator", main or generator, False, f"no [zramN] section ({what})", fix
        )
    shown = main or read_from[-1]
    return ZramService(
        "zram-generator",
        shown,
        True,
        f"{', '.join(sorted(set(sections)))} configured in /{shown.relative_to(root)}",
        fix,
    )


def read_zram_services(root: Path = ROOT, cmdline: tuple[str, ...] = ()) -> tuple[ZramService, ...]:
    """Every zram boot service installed under ``root``, enabled or not."""
    generator = _generator_service(root, cmdline)
    return _unit_services(root, ZRAM_UNITS) + ((generator,) if generator else ())


def read_swapfile_services(root: Path = ROOT) -> tuple[ZramService, ...]:
    """Services that create a swap file at boot (dphys-swapfile), enabled or not."""
    return _unit_services(root, SWAPFILE_UNITS)


def _unit_services(root: Path, units: Mapping[str, str]) -> tuple[ZramService, ...]:
    """The services of ``units`` (name -> unit) installed under ``root``, in that order."""
    found = (_unit_service(root, name, unit) for name, unit in units.items())
    return tuple(s for s in found if s is not None)
