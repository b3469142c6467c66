"""systest results: parsing the guest's JSON lines, the console fallback, the exit code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the systest package

from systest import report
from systest.report import FAIL, NOT_AVAILABLE, PASS, StepResult


def line(**kw: object) -> str:
    return json.dumps(kw)


GUEST_LINES = [
    line(event="begin", steps=["guest-facts", "plan", "apply"]),
    line(step="guest-facts", status="pass", reason="cgroup2", duration_s=0.4, details={"a": 1}),
    line(step="plan", status="not-available", reason="no verb", duration_s=3),
]


def test_parse_results_reads_steps_and_events() -> None:
    parsed = report.parse_results([*GUEST_LINES, line(event="end")])
    assert [s.step for s in parsed.steps] == ["guest-facts", "plan"]
    assert parsed.steps[0] == StepResult("guest-facts", PASS, "cgroup2", 0.4, "guest", {"a": 1})
    assert parsed.steps[1].duration_s == 3.0
    assert parsed.finished
    assert parsed.bad_lines == ()
    assert report.expected_steps(parsed.events) == ("guest-facts", "plan", "apply")


def test_unfinished_run_reports_missing_steps_as_failures() -> None:
    parsed = report.parse_results([*GUEST_LINES, '{"step": "apply", "sta'])  # died mid-write
    assert not parsed.finished
    assert len(parsed.bad_lines) == 1 and "not JSON" in parsed.bad_lines[0]
    missing = report.missing_steps(parsed, "qemu timed out")
    assert [(m.step, m.status) for m in missing] == [("apply", FAIL)]
    assert "qemu timed out" in missing[0].reason


def test_console_fallback_takes_prefixed_lines_only() -> None:
    console = [
        "[   12.3] systemd[1]: Started foo.",
        "\r" + report.CONSOLE_PREFIX + GUEST_LINES[0],
        '[   13.0] random noise {"step": "x"}',
        "[   14.0] systest-runner[99]: " + report.CONSOLE_PREFIX + GUEST_LINES[1] + "\r",
    ]
    parsed = report.parse_results(console, prefix=report.CONSOLE_PREFIX)
    assert [s.step for s in parsed.steps] == ["guest-facts"]
    assert report.expected_steps(parsed.events)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[1, 2]", "expected an object"),
        (line(status="pass"), "missing step name"),
        (line(step="x", status="ok"), "unknown status"),
        (line(step="x", status="pass", duration_s="fast"), "duration_s is not a number"),
        (line(step="x", status="pass", duration_s=True), "duration_s is not a number"),
        (line(step="x", status="pass", details=[1]), "details is not an object"),
    ],
)
def test_malformed_records_are_reported_not_raised(text: str, problem: str) -> None:
    parsed = report.parse_results([text, GUEST_LINES[1]])
    assert [s.step for s in parsed.steps] == ["guest-facts"]
    assert len(parsed.bad_lines) == 1
    assert problem in parsed.bad_lines[0]
    assert parsed.bad_lines[0].startswith("results line 1")


def test_a_step_reported_twice_keeps_the_last_record() -> None:
    parsed = report.parse_results(
        [
            line(step="a", status="fail"),
            line(step="b", status="pass"),
            line(step="a", status="pass"),
        ]
    )
    assert [(s.step, s.status) for s in parsed.steps] == [("b", PASS), ("a", PASS)]


@pytest.mark.parametrize(
    ("statuses", "strict", "code"),
    [
        ([PASS, PASS], False, 0),
        ([PASS, NOT_AVAILABLE], False, 0),
        ([PASS, NOT_AVAILABLE], True, 1),
        ([PASS, FAIL], False, 1),
        ([FAIL], True, 1),
        ([], False, 1),  # checked nothing: not a pass
    ],
)
def test_exit_code_policy(statuses: list[str], strict: bool, code: int) -> None:
    results = [StepResult(f"s{i}", s) for i, s in enumerate(statuses)]
    assert report.exit_code(results, strict) == code


def test_round_trip_through_json() -> None:
    r = StepResult("boot", PASS, "tcg", 12.3456, "host", {"k": [1, 2]})
    parsed = report.parse_results([r.to_json()])
    assert parsed.steps == (StepResult("boot", PASS, "tcg", 12.346, "host", {"k": [1, 2]}),)


def test_table_lists_every_step_with_time_and_totals() -> None:
    results = [
        StepResult("image", PASS, "cached", 1.25, "host"),
        StepResult("apply", FAIL, "exit 78\nsecond line", 7.0),
        StepResult("watch", NOT_AVAILABLE, "no verb"),
    ]
    table = report.format_table(results).splitlines()
    assert table[0].split() == ["where", "status", "time", "step", "reason"]
    assert table[1].split()[:4] == ["host", "pass", "1.2s", "image"]
    assert "exit 78 second line" in table[2]
    assert table[-1].startswith("1 passed, 1 failed, 1 not available; host steps 1.2s")
