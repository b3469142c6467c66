"""The Raspberry Pi firmware's throttle flags: under-voltage, capped, throttled, soft limit.

Owns the firmware's ``get_throttled`` value, which the Raspberry Pi kernel's firmware
driver (``drivers/firmware/raspberrypi.c``, platform driver ``raspberrypi-firmware``,
since rpi-4.14) shows as a sysfs attribute of the firmware device, in hex without
``0x`` (``50005``): ``/sys/devices/platform/soc/soc:firmware/get_throttled`` up to the
Pi 4, ``/sys/devices/platform/soc@107c000000/soc@107c000000:firmware/get_throttled``
on the Pi 5 (the node under ``soc@107c000000`` in ``bcm2712-rpi.dtsi``); the
driver's directory links to the device either way, so that is looked in first.
The bits (the firmware's ``vcgencmd get_throttled``): 0 under-voltage, 1 ARM
frequency capped, 2 currently throttled, 3 soft temperature limit active, now; bits
16-19 the same "has occurred since boot". None where there is no such file (not a
Pi). Pure parser apart from the reader; no writes (``get_throttled_mask`` stays).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slmguard.host import files
from slmguard.host.files import ROOT

DRIVER_DIR = "sys/bus/platform/drivers/raspberrypi-firmware"
ATTR = "get_throttled"
KNOWN = (
    "sys/devices/platform/soc/soc:firmware/get_throttled",
    "sys/devices/platform/soc@107c000000/soc@107c000000:firmware/get_throttled",
)
MAX_DEVICES = 8

UNDER_VOLTAGE, CAPPED, THROTTLED, SOFT_TEMP_LIMIT = 0, 1, 2, 3
NAMES = {
    UNDER_VOLTAGE: "under-voltage",
    CAPPED: "ARM frequency capped",
    THROTTLED: "throttled",
    SOFT_TEMP_LIMIT: "soft temperature limit",
}
SINCE_BOOT = 16  # the sticky copy of each bit


@dataclass(frozen=True)
class ThrottleFlags:
    """The firmware's ``get_throttled`` word, with the file it came from."""

    value: int
    source: str  # relative to the root

    def now(self, bit: int) -> bool:
        return bool(self.value >> bit & 1)

    def since_boot(self, bit: int) -> bool:
        return bool(self.value >> (SINCE_BOOT + bit) & 1)

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(NAMES[b] for b in sorted(NAMES) if self.now(b))

    @property
    def occurred(self) -> tuple[str, ...]:
        return tuple(NAMES[b] for b in sorted(NAMES) if self.since_boot(b))

    @property
    def slowed_now(self) -> bool:
        """The firmware holds the clock down now: throttled, capped or at its soft limit."""
        return any(self.now(b) for b in (CAPPED, THROTTLED, SOFT_TEMP_LIMIT))

    def describe(self) -> str:
        """``0x50005: now under-voltage, throttled; since boot under-voltage, throttled``."""
        parts = []
        if self.active:
            parts.append("now " + ", ".join(self.active))
        if self.occurred:
            parts.append("since boot " + ", ".join(self.occurred))
        return f"{self.value:#x}: " + ("; ".join(parts) if parts else "none")


def parse_throttled(text: str) -> int | None:
    """``"50005\\n"`` (hex, ``0x`` optional) -> 0x50005; None when not a 32-bit hex word."""
    word = text.strip().lower().removeprefix("0x")
    if not word or len(word) > 8:
        return None
    try:
        return int(word, 16)
    except ValueError:
        return None


def _candidates(root: Path) -> list[Path]:
    found: list[Path] = []
    try:
        entries = sorted((root / DRIVER_DIR).iterdir())[:MAX_DEVICES]
    except OSError:
        entries = []
    found += [e / ATTR for e in entries if ":" in e.name or "firmware" in e.name]
    return found + [root / rel for rel in KNOWN]


def _shown(root: Path, path: Path) -> str:
    """The device's own path below the root (the driver's link resolved), else as found."""
    try:
        real, base = path.resolve(), root.resolve()
    except OSError:
        real, base = path, root
    for p, r in ((real, base), (path, root)):
        if p.is_relative_to(r):
            return str(p.relative_to(r))
    return str(path)


def read_throttle_flags(root: Path = ROOT) -> ThrottleFlags | str | None:
    """The flags; None when no firmware exposes them (not a Raspberry Pi); a string
    saying why when the file is there but gave nothing usable."""
    for path in _candidates(root):
        attr = files.read_attr(path)
        if attr.absent:
            continue
        rel = _shown(root, path)
        if attr.text is None:
            return f"{rel}: {attr.error}"
        value = parse_throttled(attr.text)
        if value is None:
            return f"{rel}: not a hex word: {attr.text.strip()[:20]!r}"
        return ThrottleFlags(value, rel)
    return None
