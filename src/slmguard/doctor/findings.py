"""What a doctor check returns, and how a report turns into an exit status.

Owns the order of the severities, the :class:`Report` value object, the :data:`Check`
signature, :class:`CheckId` (which builds a check's findings, and says when its input
was not read), the exit status of a report and the MiB formatting every finding uses.
A finding is a :class:`slmguard.tuning.notes.Note` (the severities, :class:`Evidence`
and the fields are declared there, once: the doctor's tuning checks pass the tuning
notes on as they are). Holds no checks and reads nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from slmguard.host.snapshot import HostSnapshot, Unread
from slmguard.plan.schema import Plan
from slmguard.tuning.notes import FAIL, PASS, UNKNOWN, WARN, Evidence, Note, NoteId

__all__ = [
    "FAIL", "MIB", "PASS", "SEVERITIES", "UNKNOWN", "WARN",
    "Check", "CheckId", "Evidence", "Finding", "Report", "mib",
]  # fmt: skip

SEVERITIES = (PASS, UNKNOWN, WARN, FAIL)  # in increasing order of concern

MIB = 1024 * 1024

#: What a check returns: id, title, severity, summary, evidence, fix.
Finding = Note


@dataclass(frozen=True)
class Report:
    root: str
    euid: int
    findings: tuple[Finding, ...]
    not_seen: tuple[str, ...] = field(default_factory=tuple)

    def count(self, severity: str) -> int:
        return sum(1 for f in self.findings if f.severity == severity)

    def exit_code(self, strict: bool = False) -> int:
        sev = {f.severity for f in self.findings}
        if FAIL in sev:
            return 2
        if WARN in sev or (strict and UNKNOWN in sev):
            return 1
        return 0


#: A check: pure, never reads files, one finding per call.
Check = Callable[[HostSnapshot, Plan | None], Finding]


def mib(n: int | None) -> str:
    if n is None:
        return "unlimited"
    if n % MIB == 0 or n >= 100 * MIB:
        return f"{n / MIB:.0f} MiB"
    return f"{n / MIB:.1f} MiB"


class CheckId(NoteId):
    """A check's id and title, which every finding it returns carries."""

    finding = NoteId.note

    def unread(self, unread: Unread, fix: str | None = None) -> Finding:
        """``unknown``: the input the check needs could not be read."""
        return self.note(UNKNOWN, f"could not read {unread.path}: {unread.reason}", fix=fix)
