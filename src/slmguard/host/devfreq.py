"""Every devfreq device: the DDR controller, the NPU, the GPU, and how each is clocked.

Owns ``/sys/class/devfreq/<name>/`` (Documentation/ABI/testing/sysfs-class-devfreq):
``governor``, ``available_governors``, ``cur_freq``, ``min_freq``, ``max_freq``,
``available_frequencies`` (Hz), and the Rockchip BSP's ``load`` (``LOAD@FREQHz``);
and which device is which (:func:`device_kind`): the DDR controller (Rockchip's
``dmc``, a ``*dram*``/``*ddr*``/``*mbus*`` device), an NPU (``fdab0000.npu``) or a GPU
(``fb000000.gpu``, Jetson's ``17000000.gpu``). Whether a top frequency is reachable
(:attr:`Devfreq.capped`, :attr:`Devfreq.pinned_low`) is decided here; what that means
for a plan is :mod:`slmguard.tuning`'s. Nothing found is an empty tuple; a file that
is there but unreadable says why (``needs root``), never a 0. No writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from slmguard.host import files
from slmguard.host.files import ROOT

DEVFREQ_DIR = "sys/class/devfreq"
#: Bounds on what a hostile tree can make us read.
MAX_DEVICES = 32
MAX_FREQS = 64
MAX_GOVERNORS = 32

_MEMORY = re.compile(r"(^|[^a-z])(dmc|ddr|dram|mbus|emc)([^a-z]|$)")


@dataclass(frozen=True)
class Devfreq:
    """One devfreq device. Frequencies in Hz; None where the file is absent or garbled."""

    name: str  # the directory name: dmc, fb000000.gpu, fdab0000.npu
    kind: str  # "memory" | "npu" | "gpu" | "other" (device_kind)
    source: str  # the directory, relative to the root
    governor: str | None = None
    available_governors: tuple[str, ...] = ()
    cur_hz: int | None = None
    min_hz: int | None = None
    max_hz: int | None = None
    available_hz: tuple[int, ...] = ()
    load_pct: float | None = None  # Rockchip BSP's ``load`` (LOAD@FREQHz)
    error: str | None = None  # why cur_freq could not be read (needs root ...)

    @property
    def top_hz(self) -> int | None:
        """The highest frequency the device lists (its top OPP)."""
        return max(self.available_hz) if self.available_hz else None

    @property
    def capped(self) -> bool:
        """``max_freq`` below the top listed frequency: the top is not reachable."""
        top = self.top_hz
        return top is not None and self.max_hz is not None and self.max_hz < top

    @property
    def pinned_low(self) -> bool:
        """Held below the top whatever the load: ``powersave``, or ``userspace`` with the
        current frequency below the top."""
        top = self.top_hz
        if self.governor == "powersave":
            return top is not None and (self.min_hz is None or self.min_hz < top)
        if self.governor == "userspace":
            return top is not None and self.cur_hz is not None and self.cur_hz < top
        return False


def device_kind(name: str) -> str:
    """What a devfreq device clocks, from its name: memory, npu, gpu or other."""
    lname = name.lower()
    if "npu" in lname:
        return "npu"
    if "gpu" in lname:
        return "gpu"
    if _MEMORY.search(lname):
        return "memory"
    return "other"


def parse_hz_list(text: str) -> tuple[int, ...]:
    """``available_frequencies``: space-separated Hz, sorted, at most :data:`MAX_FREQS`;
    words that are not numbers are skipped."""
    values = sorted({int(w) for w in text.split()[: MAX_FREQS * 2] if w.isdigit()})
    return tuple(values[:MAX_FREQS])


def parse_words(text: str, limit: int = MAX_GOVERNORS) -> tuple[str, ...]:
    """``available_governors``: space-separated names, at most ``limit``."""
    return tuple(w[:64] for w in text.split()[:limit])


def parse_load(text: str) -> tuple[float, int | None] | None:
    """Rockchip's ``load``: ``"37@800000000Hz"`` -> (37.0, 800000000); a bare number is
    a percent; None when it is neither."""
    m = re.match(r"\s*(\d+(?:\.\d+)?)\s*(?:@\s*(\d+)\s*Hz)?\s*$", text)
    if not m:
        return None
    return float(m.group(1)), int(m.group(2)) if m.group(2) else None


def _text(path: Path) -> str | None:
    text = files.read_attr(path).text
    return text.strip() if text is not None else None


def read_device(root: Path, path: Path) -> Devfreq:
    """One devfreq directory."""
    cur = files.read_attr(path / "cur_freq")
    load = parse_load(_text(path / "load") or "")
    return Devfreq(
        name=path.name,
        kind=device_kind(path.name),
        source=str(path.relative_to(root)) if path.is_relative_to(root) else str(path),
        governor=_text(path / "governor") or None,
        available_governors=parse_words(_text(path / "available_governors") or ""),
        cur_hz=cur.integer(),
        min_hz=files.read_attr(path / "min_freq").integer(),
        max_hz=files.read_attr(path / "max_freq").integer(),
        available_hz=parse_hz_list(_text(path / "available_frequencies") or ""),
        load_pct=load[0] if load is not None else None,
        error=cur.error,
    )


def read_devfreq(root: Path = ROOT) -> tuple[Devfreq, ...]:
    """Every devfreq device under ``root``, by name (empty on a VM or without devfreq)."""
    base = root / DEVFREQ_DIR
    try:
        entries = sorted(base.iterdir())[:MAX_DEVICES]
    except OSError:
        return ()
    return tuple(read_device(root, p) for p in entries)
