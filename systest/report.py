"""Step results: the guest's JSON lines, the host's own steps, the report, the exit code.

Owns the result record shared by the host driver and the guest scenario, the
parser for the guest's results file (JSON lines, one object per line) and for
the serial-console fallback (the same objects behind a prefix), the table
printed at the end and the exit-code policy. Pure: no I/O.

A step is ``pass``, ``fail`` or ``not-available`` (the slmguard verb it needs
is not in the installed package yet). ``--strict`` turns not-available into a
failure. A step the scenario was expected to run but never reported (the
guest crashed or timed out) is a failure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PASS = "pass"
FAIL = "fail"
NOT_AVAILABLE = "not-available"
STATUSES = (PASS, FAIL, NOT_AVAILABLE)

CONSOLE_PREFIX = "SYSTEST-RESULT "
"""Prefix of a result line echoed on the serial console (the fallback channel)."""


@dataclass(frozen=True)
class StepResult:
    """One step of the systest: where it ran, its outcome, why, how long."""

    step: str
    status: str
    reason: str = ""
    duration_s: float = 0.0
    where: str = "guest"  # "host" or "guest"
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "status": self.status,
                "reason": self.reason,
                "duration_s": round(self.duration_s, 3),
                "where": self.where,
                "details": self.details,
            },
            sort_keys=True,
        )


class ResultFormatError(ValueError):
    """A results line that is not a step record; ``line_no`` is 1-based."""

    def __init__(self, line_no: int, problem: str) -> None:
        super().__init__(f"results line {line_no}: {problem}")
        self.line_no = line_no
        self.problem = problem


def parse_record(obj: Any, line_no: int = 0) -> StepResult | None:
    """A step record from a decoded JSON value; ``None`` for non-step events.

    Lines with an ``"event"`` key (begin/end markers, progress) are not steps.
    """
    if not isinstance(obj, dict):
        raise ResultFormatError(line_no, f"expected an object, got {type(obj).__name__}")
    if "event" in obj:
        return None
    step, status = obj.get("step"), obj.get("status")
    if not isinstance(step, str) or not step:
        raise ResultFormatError(line_no, "missing step name")
    if status not in STATUSES:
        raise ResultFormatError(line_no, f"step {step!r}: unknown status {status!r}")
    duration = obj.get("duration_s", 0.0)
    if isinstance(duration, bool) or not isinstance(duration, int | float):
        raise ResultFormatError(line_no, f"step {step!r}: duration_s is not a number")
    details = obj.get("details") or {}
    if not isinstance(details, dict):
        raise ResultFormatError(line_no, f"step {step!r}: details is not an object")
    return StepResult(
        step=step,
        status=status,
        reason=str(obj.get("reason", "")),
        duration_s=float(duration),
        where=str(obj.get("where", "guest")),
        details=details,
    )


@dataclass(frozen=True)
class ParsedResults:
    """What the guest reported: its steps, its events, and whether it finished."""

    steps: tuple[StepResult, ...]
    events: tuple[dict[str, Any], ...]
    finished: bool  # an {"event": "end"} line was seen
    bad_lines: tuple[str, ...]  # problems with lines that could not be used


def parse_results(lines: Iterable[str], prefix: str = "") -> ParsedResults:
    """Parse JSON lines; with ``prefix``, only lines containing it (console fallback).

    A truncated last line (the guest died mid-write) or a malformed line is
    reported in ``bad_lines`` rather than raised, so one bad line does not hide
    the others. A step reported twice keeps its last record.
    """
    steps: dict[str, StepResult] = {}
    events: list[dict[str, Any]] = []
    bad: list[str] = []
    finished = False
    for no, raw in enumerate(lines, 1):
        text = raw.strip().replace("\r", "")
        if prefix:
            at = text.find(prefix)
            if at < 0:
                continue
            text = text[at + len(prefix) :]
        if not text:
            continue
        try:
            obj = json.loads(text)
            rec = parse_record(obj, no)
        except json.JSONDecodeError as err:
            bad.append(f"line {no}: not JSON ({err.msg})")
            continue
        except ResultFormatError as err:
            bad.append(str(err))
            continue
        if rec is None:
            events.append(obj)
            finished = finished or obj.get("event") == "end"
        else:
            steps.pop(rec.step, None)
            steps[rec.step] = rec
    return ParsedResults(tuple(steps.values()), tuple(events), finished, tuple(bad))


def expected_steps(events: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The step names the guest announced in its ``begin`` event (empty if none)."""
    for ev in events:
        if ev.get("event") == "begin" and isinstance(ev.get("steps"), list):
            return tuple(str(s) for s in ev["steps"])
    return ()


def missing_steps(parsed: ParsedResults, why: str) -> list[StepResult]:
    """A failure for each announced step that never reported, saying ``why``."""
    seen = {s.step for s in parsed.steps}
    return [
        StepResult(step=name, status=FAIL, reason=f"never reported: {why}")
        for name in expected_steps(parsed.events)
        if name not in seen
    ]


def exit_code(results: Sequence[StepResult], strict: bool) -> int:
    """0 when every step passed (or was not available, unless strict); else 1.

    No results at all is a failure: a systest that checked nothing did not pass.
    """
    if not results:
        return 1
    bad = {FAIL, NOT_AVAILABLE} if strict else {FAIL}
    return 1 if any(r.status in bad for r in results) else 0


def summary_counts(results: Sequence[StepResult]) -> dict[str, int]:
    counts = dict.fromkeys(STATUSES, 0)
    for r in results:
        counts[r.status] += 1
    return counts


def format_table(results: Sequence[StepResult]) -> str:
    """The report: one line per step (where, status, time, name, reason), then totals."""
    width = max([len(r.step) for r in results] + [4])
    lines = [f"{'where':<6} {'status':<13} {'time':>8}  {'step':<{width}}  reason"]
    for r in results:
        reason = r.reason.replace("\n", " ")
        row = f"{r.where:<6} {r.status:<13} {r.duration_s:>7.1f}s  {r.step:<{width}}  {reason}"
        lines.append(row.rstrip())
    counts = summary_counts(results)
    total_s = sum(r.duration_s for r in results if r.where == "host")
    lines.append(
        f"{counts[PASS]} passed, {counts[FAIL]} failed, "
        f"{counts[NOT_AVAILABLE]} not available; host steps {total_s:.1f}s"
    )
    return "\n".join(lines)
