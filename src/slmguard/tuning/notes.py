"""What a tuning check returns: a note with its severity, evidence and fix.

Owns :class:`Note` and :class:`Evidence` (the shape of a check's result: the doctor's
findings are notes, and ``top`` shows them), the severities, :class:`NoteId` (which
builds a check's notes; the doctor's ``CheckId`` is one) and :class:`Target` (what the
checks compare the board with: the cores the service runs on, the plan's threads, the
zones it names, whether it uses the NPU or the GPU). Holds no checks and reads nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PASS, WARN, FAIL, UNKNOWN = "pass", "warn", "fail", "unknown"


@dataclass(frozen=True)
class Evidence:
    """One value a check relied on and the file it came from (relative to the root)."""

    label: str
    value: str
    source: str


@dataclass(frozen=True)
class Note:
    id: str
    title: str
    severity: str
    summary: str
    evidence: tuple[Evidence, ...] = ()
    fix: str | None = None


@dataclass(frozen=True)
class NoteId:
    """A check's id and title, which every note it returns carries."""

    id: str
    title: str

    def note(
        self, severity: str, summary: str, evidence: Iterable[Evidence] = (), fix: str | None = None
    ) -> Note:
        return Note(self.id, self.title, severity, summary, tuple(evidence), fix)

    def passed(self, summary: str, evidence: Iterable[Evidence] = ()) -> Note:
        return self.note(PASS, summary, evidence)

    def warn(self, summary: str, evidence: Iterable[Evidence] = (), fix: str | None = None) -> Note:
        return self.note(WARN, summary, evidence, fix)

    def fail(self, summary: str, evidence: Iterable[Evidence] = (), fix: str | None = None) -> Note:
        return self.note(FAIL, summary, evidence, fix)

    def unknown(self, summary: str, evidence: Iterable[Evidence] = ()) -> Note:
        return self.note(UNKNOWN, summary, evidence)


@dataclass(frozen=True)
class Target:
    """What the board is checked for.

    ``cpus``: the cores the service runs on (its CPUAffinity=, the plan's, the engine's
    affinity; every online core when nothing pins it), and ``cpus_from`` says which.
    ``threads``: the engine's threads (None: no plan). ``zones``: the thermal zones the
    plan names (empty: every zone with a passive or hot trip). ``npu``/``gpu``: the plan
    reserves NPU memory / offloads layers to the GPU.
    """

    cpus: tuple[int, ...] = ()
    cpus_from: str = "every online core"
    threads: int | None = None
    zones: tuple[str, ...] = ()
    npu: bool = False
    gpu: bool = False


def cpu_list(cpus: Iterable[int]) -> str:
    """``(4, 5, 6, 7)`` -> ``"4-7"``; ``(0, 2, 3)`` -> ``"0,2-3"``."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def mhz(hz_or_khz: int | None, unit_hz: int = 1000) -> str:
    """A clock as MHz: ``mhz(2400000)`` (kHz) -> ``"2400 MHz"``; ``unit_hz=1`` for Hz."""
    if hz_or_khz is None:
        return "?"
    value = hz_or_khz * unit_hz / 1e6
    return f"{value:.0f} MHz" if value == int(value) else f"{value:.1f} MHz"
