"""Every use of the wall clock in slmguard is a label, never a duration (issue 40).

A board without an RTC boots in 1970 and jumps decades forward at NTP sync; an operator
sets the date by hand. Any timer, TTL, rate window, cooldown, cursor or stall clock that
subtracts wall-clock readings breaks then (a cooldown that never ends or ends at once,
a stall detected or never detected, the wrong bundle pruned). Durations use
``time.monotonic()`` (or CLOCK_BOOTTIME across restarts within a boot); the wall clock
only stamps records for people (``at_unix_s``, an alert's ``time``, a bundle's name).

This test walks the package's syntax trees and lists every reference to the wall clock
(``time.time``, ``datetime.now``/``utcnow``/``today``, ``date.today``) and every
arithmetic on a file's ``st_mtime``/``st_ctime``/``st_atime``; each must be in
:data:`LABELS`, which says why it is one. A new use fails here until it is judged.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "slmguard"

#: (module, enclosing function or class) -> why that wall-clock reading is only a label.
LABELS = {
    ("governor/runtime.py", "_record_transition"): "a transition's at_unix_s, for people",
    ("governor/recycling.py", "run"): "a recycle's at_unix_s, for people",
    ("serve/sessions.py", "append"): "a stored message's created_s, never compared",
    ("serve/liveness.py", "stalled"): "the stall evidence's time, for people",
    ("serve/served.py", "ServedModel"): "/v1/models' created, OpenAI's label",
    ("watch/sources.py", "read"): "a snapshot's unix_s: alert times and the last trim's "
    "wall time (used only across a reboot, where no other clock survives)",
    ("watch/bundle.py", "write_bundle"): "a bundle's name and summary time (retention "
    "follows its sequence, not the name)",
    ("watch/alerts.py", "alert_record"): "an alert's time, for people",
    ("watch/daemon.py", "__init__"): "the injectable wall clock, read only across a reboot",
    ("top/sources.py", "__init__"): "top's screen time and event times, for people",
    ("bench/runner.py", "run_bench"): "a bench record's started_unix_s, for people",
    ("bench/runner.py", "build_record"): "a bench record's finished_unix_s, for people",
    ("governor/heat.py", "_record"): "a heat step's at_unix_s, for people",
    ("host/boardstate.py", "read_board_state"): "the state's taken_unix_s (the default of "
    "its injectable clock), for people",
}

_WALL = {("time", "time"), ("datetime", "now"), ("datetime", "utcnow"),
         ("datetime", "today"), ("date", "today")}  # fmt: skip
_STAT_TIMES = {"st_mtime", "st_ctime", "st_atime"}


def _uses(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function or class, line) of every wall-clock reference in ``tree``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            scope = node.name
        if isinstance(node, ast.Attribute):
            base = node.value
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if (name, node.attr) in _WALL or node.attr in _STAT_TIMES:
                found.append((scope, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, "<module>")
    return found


def test_the_wall_clock_is_only_ever_a_label() -> None:
    unjudged = []
    seen = set()
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC).as_posix()
        for scope, line in _uses(ast.parse(path.read_text(encoding="utf-8"))):
            seen.add((module, scope))
            if (module, scope) not in LABELS:
                unjudged.append(f"{module}:{line} in {scope}")
    assert not unjudged, (
        "wall-clock readings not judged as labels (use time.monotonic() for durations, "
        f"or add them to LABELS with the reason): {unjudged}"
    )
    assert set(LABELS) <= seen, f"LABELS names uses that are gone: {set(LABELS) - seen}"


def test_the_audit_finds_what_it_looks_for() -> None:
    code = (
        "import time, datetime\n"
        "def cooldown(last):\n    return time.time() - last\n"
        "class C:\n    t = datetime.datetime.now()\n"
        "def age(st):\n    return st.st_mtime\n"
    )
    assert _uses(ast.parse(code)) == [("cooldown", 3), ("C", 5), ("age", 7)]
