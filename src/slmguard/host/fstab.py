"""/etc/fstab: the swap lines that turn swap back on at boot.

Owns finding ``swap`` entries (fstab(5): spec, file, vfstype, options, dump,
pass). systemd-fstab-generator turns each into a ``.swap`` unit unless its
options contain ``noauto``; ``swapon -a`` honours the same. Commented lines are
ignored. Nothing here edits the file (``slmguard.deploy.system`` does, with
:func:`is_swap_entry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slmguard.host import files
from slmguard.host.files import ROOT

FSTAB = "etc/fstab"


@dataclass(frozen=True)
class FstabSwap:
    lineno: int
    line: str
    spec: str  # device, UUID=..., or a swap file path
    options: tuple[str, ...]

    @property
    def at_boot(self) -> bool:
        return "noauto" not in self.options


def is_swap_entry(line: str) -> bool:
    """Whether an fstab line is an active swap entry (not a comment, vfstype ``swap``).

    The one rule: ``doctor`` reads swap lines with it and ``apply`` comments
    out exactly the lines it matches.
    """
    fields = line.split()
    return len(fields) >= 3 and not fields[0].startswith("#") and fields[2] == "swap"


def parse_fstab_swaps(text: str) -> tuple[FstabSwap, ...]:
    out: list[FstabSwap] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not is_swap_entry(raw):
            continue
        fields = raw.split()
        options = tuple(fields[3].split(",")) if len(fields) > 3 else ("defaults",)
        out.append(FstabSwap(lineno, raw, fields[0].replace("\\040", " "), options))
    return tuple(out)


def read_fstab_swaps(root: Path = ROOT) -> tuple[FstabSwap, ...]:
    """Swap lines of root/etc/fstab; an absent fstab has none."""
    text = files.read(root / FSTAB).optional()
    return () if text is None else parse_fstab_swaps(text)
