"""The Jetson power mode: which nvpmodel mode the board runs and what each mode allows.

Owns two files L4T's ``nvpmodel`` tool keeps (no root and no binary needed to read them):
``/etc/nvpmodel.conf`` (a link to the module's ``nvpmodel_p3767_000N.conf``): every
``< POWER_MODEL ID=N NAME=... >`` block with its parameter lines (``CPU_ONLINE CORE_4 0``
takes a core offline; ``CPU_A78_0 MAX_FREQ 1497600`` caps a CPU cluster in kHz, ``GPU
MAX_FREQ`` and ``EMC MAX_FREQ`` the GPU and the memory controller in Hz, ``-1`` for no cap)
and ``< PM_CONFIG DEFAULT=N >``; and ``/var/lib/nvpmodel/status`` (``pmode:0002
fmode:...``), the mode set last, which ``nvpmodel`` restores at boot. A board without
them is not a Jetson: None. Pure parsers apart from the reader; nothing decides which
mode is right for a plan (:mod:`slmguard.tuning` does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import files
from slmguard.host.files import ROOT

CONF = "etc/nvpmodel.conf"
STATUS = "var/lib/nvpmodel/status"
#: Bounds on what a hostile file can make us keep.
MAX_MODES = 32
MAX_PARAMS = 256
CONF_BYTES = 256 << 10

_HEADER = re.compile(r"<\s*POWER_MODEL\s+([^>]*)>")
_DEFAULT = re.compile(r"<\s*PM_CONFIG\s+DEFAULT\s*=\s*(\d+)\s*>")
_ATTR = re.compile(r"(ID|NAME)\s*=\s*([A-Za-z0-9_.+-]{1,64})")
_PMODE = re.compile(r"pmode\s*:\s*(\d{1,6})")


@dataclass(frozen=True)
class PowerMode:
    """One ``POWER_MODEL`` block: its caps (None: not set; -1 in the file: no cap)."""

    id: int
    name: str
    offline_cores: tuple[int, ...] = ()  # CPU_ONLINE CORE_N 0
    cpu_max_khz: int | None = None  # the lowest CPU_* MAX_FREQ, -1 for none
    gpu_max_hz: int | None = None
    emc_max_hz: int | None = None


@dataclass(frozen=True)
class PowerModes:
    """What the board's nvpmodel says: the modes, the default, the one set now."""

    modes: tuple[PowerMode, ...]
    default_id: int | None = None
    current_id: int | None = None  # from the status file; None: not set since flashing
    conf_source: str = CONF
    status_source: str = STATUS
    status_error: str | None = None  # why the status file gave nothing (absent: None)
    notes: tuple[str, ...] = field(default_factory=tuple)

    def mode(self, mode_id: int | None) -> PowerMode | None:
        return next((m for m in self.modes if m.id == mode_id), None)

    @property
    def active_id(self) -> int | None:
        """The mode in force: the status file's, else the default (nvpmodel's order)."""
        return self.current_id if self.current_id is not None else self.default_id

    @property
    def active(self) -> PowerMode | None:
        return self.mode(self.active_id)


def _value(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _lowest(current: int | None, new: int | None) -> int | None:
    """The tighter of two caps (-1 is no cap)."""
    if new is None:
        return current
    if current is None or current == -1:
        return new
    if new == -1:
        return current
    return min(current, new)


def _apply(mode: PowerMode, words: list[str]) -> PowerMode:
    """One parameter line of a mode block."""
    key = words[0]
    if key == "CPU_ONLINE" and len(words) >= 3 and words[1].startswith("CORE_"):
        core = _value(words[1][5:])
        if core is not None and 0 <= core < 4096 and words[2] == "0":
            return replace(mode, offline_cores=(*mode.offline_cores, core))
        return mode
    if len(words) < 3 or words[1] != "MAX_FREQ":
        return mode
    value = _value(words[2])
    if key.startswith("CPU"):
        return replace(mode, cpu_max_khz=_lowest(mode.cpu_max_khz, value))
    if key == "GPU":
        return replace(mode, gpu_max_hz=value)
    if key == "EMC":
        return replace(mode, emc_max_hz=value)
    return mode


def parse_conf(text: str) -> tuple[tuple[PowerMode, ...], int | None]:
    """``nvpmodel.conf`` -> (modes in file order, the PM_CONFIG default)."""
    modes: list[PowerMode] = []
    default: int | None = None
    current: PowerMode | None = None
    params = 0
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _DEFAULT.search(line)
        if m:
            default = int(m.group(1))
            continue
        m = _HEADER.search(line)
        if m:
            attrs = dict(_ATTR.findall(m.group(1)))
            mode_id = _value(attrs.get("ID", ""))
            current = None
            if mode_id is not None and len(modes) < MAX_MODES:
                current = PowerMode(mode_id, attrs.get("NAME", f"mode {mode_id}"))
                modes.append(current)
            continue
        if line.startswith("<"):
            current = None  # a PARAM declaration block, not a mode's
            continue
        if current is not None and params < MAX_PARAMS:
            params += 1
            updated = _apply(current, line.split())
            modes[-1] = current = updated
    return tuple(modes), default


def parse_status(text: str) -> int | None:
    """``/var/lib/nvpmodel/status`` (``pmode:0002 fmode:quiet``) -> 2."""
    m = _PMODE.search(text)
    return int(m.group(1)) if m else None


def read_power_modes(root: Path = ROOT) -> PowerModes | None:
    """The board's nvpmodel modes and the one set, or None without ``nvpmodel.conf``
    (not a Jetson). Raises :class:`HostReadError` when the conf is there but unreadable."""
    conf = files.read(root / CONF, CONF_BYTES)
    if conf.absent:
        return None
    modes, default = parse_conf(conf.require())
    status = files.read_attr(root / STATUS)
    current = parse_status(status.text) if status.text is not None else None
    notes: list[str] = []
    if status.text is not None and current is None:
        notes.append(f"unrecognised status: {status.text.strip()[:40]!r}")
    if not modes:
        raise HostReadError(root / CONF, "no POWER_MODEL block")
    return PowerModes(
        modes=modes,
        default_id=default,
        current_id=current,
        status_error=status.error,
        notes=tuple(notes),
    )
