"""Pressure stall information (PSI): /proc/pressure/* and a cgroup's *.pressure.

Owns parsing the two-line PSI format (Documentation/accounting/psi.rst)::

    some avg10=0.00 avg60=0.00 avg300=0.00 total=0
    full avg10=0.00 avg60=0.00 avg300=0.00 total=0

``avg*`` are percentages of wall time over 10/60/300 s windows; ``total`` is
cumulative stall time in microseconds. The ``full`` line is absent for the
system-wide cpu file before Linux 5.13; for memory it is always present, but
the snapshot allows it to be missing. It does not poll or set triggers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import files

PROC_PRESSURE_MEMORY = "proc/pressure/memory"


@dataclass(frozen=True)
class Pressure:
    some_avg10_pct: float
    some_avg60_pct: float
    some_avg300_pct: float
    some_total_us: int
    full_avg10_pct: float | None = None
    full_avg60_pct: float | None = None
    full_avg300_pct: float | None = None
    full_total_us: int | None = None


def _parse_line(fields: list[str]) -> tuple[float, float, float, int]:
    values = dict(f.split("=", 1) for f in fields if "=" in f)
    try:
        return (
            float(values["avg10"]),
            float(values["avg60"]),
            float(values["avg300"]),
            int(values["total"]),
        )
    except KeyError as err:
        raise ValueError(f"PSI line lacks {err.args[0]}") from err


def parse_pressure(text: str) -> Pressure:
    """Parse PSI text. Raises ValueError without a complete ``some`` line."""
    lines: dict[str, tuple[float, float, float, int]] = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in ("some", "full"):
            lines[parts[0]] = _parse_line(parts[1:])
    if "some" not in lines:
        raise ValueError("no 'some' line")
    s10, s60, s300, stotal = lines["some"]
    if "full" not in lines:
        return Pressure(s10, s60, s300, stotal)
    f10, f60, f300, ftotal = lines["full"]
    return Pressure(s10, s60, s300, stotal, f10, f60, f300, ftotal)


def read_pressure(path: Path) -> Pressure:
    """Read a PSI file (``/proc/pressure/memory`` or a cgroup's ``memory.pressure``).

    A kernel booted with ``psi=0`` keeps the file but fails the read with
    EOPNOTSUPP; that, a missing file and garbled text all raise HostReadError.
    """
    text = files.read(path).require(missing="missing (kernel without CONFIG_PSI?)")
    try:
        return parse_pressure(text)
    except ValueError as err:
        raise HostReadError(path, f"not PSI text: {err}") from err
