"""What a doctor check returns, and how a report turns into an exit status.

Owns the severities (``pass``, ``unknown``, ``warn``, ``fail``), the
:class:`Evidence` / :class:`Finding` / :class:`Report` value objects, the
:data:`Check` signature, :class:`CheckId` (which builds a check's findings),
the exit status of a report and the MiB formatting every finding uses. Holds
no checks and reads nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from slmguard.host.snapshot import HostSnapshot, Unread
from slmguard.plan.schema import Plan

PASS, WARN, FAIL, UNKNOWN = "pass", "warn", "fail", "unknown"
SEVERITIES = (PASS, UNKNOWN, WARN, FAIL)  # in increasing order of concern

MIB = 1024 * 1024


@dataclass(frozen=True)
class Evidence:
    """One value a check relied on and where it came from."""

    label: str
    value: str
    source: str


@dataclass(frozen=True)
class Finding:
    id: str
    title: str
    severity: str
    summary: str
    evidence: tuple[Evidence, ...] = ()
    fix: str | None = None


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


@dataclass(frozen=True)
class CheckId:
    """A check's id and title, which every finding it returns carries."""

    id: str
    title: str

    def finding(
        self,
        severity: str,
        summary: str,
        evidence: Iterable[Evidence] = (),
        fix: str | None = None,
    ) -> Finding:
        return Finding(self.id, self.title, severity, summary, tuple(evidence), fix)

    def passed(self, summary: str, evidence: Iterable[Evidence] = ()) -> Finding:
        return self.finding(PASS, summary, evidence)

    def warn(
        self, summary: str, evidence: Iterable[Evidence] = (), fix: str | None = None
    ) -> Finding:
        return self.finding(WARN, summary, evidence, fix)

    def fail(
        self, summary: str, evidence: Iterable[Evidence] = (), fix: str | None = None
    ) -> Finding:
        return self.finding(FAIL, summary, evidence, fix)

    def unknown(self, summary: str, evidence: Iterable[Evidence] = ()) -> Finding:
        return self.finding(UNKNOWN, summary, evidence)

    def unread(self, unread: Unread, fix: str | None = None) -> Finding:
        """``unknown``: the input the check needs could not be read."""
        return self.finding(UNKNOWN, f"could not read {unread.path}: {unread.reason}", fix=fix)
