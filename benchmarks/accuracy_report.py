"""What the plan-accuracy benchmarks' report writers share.

``plan_accuracy.py`` and the cells it runs through ``--offload``, ``--vision`` and
``--board`` (``plan_accuracy_offload.py``, ``plan_accuracy_vision.py``,
``plan_accuracy_board.py``) each print a table of measured cells against the plan and
write their own RESULTS.md section; this module holds the pieces they write alike: a
cell's error, a size in the tables' MiB, the cells file as the commands show it, when
the cells were measured, the commands line, and the report's printing and writing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from results_md import write_section

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def err_pct(pred: float, meas: float) -> float:
    """How far the plan is from the measure, in percent of the measure (+: over)."""
    return (pred - meas) / meas * 100


def mib(n: float) -> str:
    """A size in the tables: MiB, one decimal, no unit."""
    return f"{n / MiB:.1f}"


def shown_path(path: Path) -> str:
    """The cells file relative to the repository when it is under it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def measured_span(entries: list[dict[str, Any]]) -> tuple[str, str]:
    """When the first and the last cell were measured (``measured_at``, UTC)."""
    return min(e["measured_at"] for e in entries), max(e["measured_at"] for e in entries)


def commands(path: Path, mode: str = "") -> str:
    """The commands line: measure the cells into ``path``, then report (``mode``: the
    cells ``plan_accuracy.py`` runs instead of its own, ``board`` or ``vision``)."""
    flag = f"--{mode} " if mode else ""
    rel = shown_path(path)
    return (
        f"Commands: `.venv/bin/python benchmarks/plan_accuracy.py {flag}--measure {rel}` "
        f"then `{flag}--report {rel} --write-results`."
    )


def print_report(
    lines: list[str], worst: str, title: str, section: Callable[[], str], write: bool
) -> int:
    """Print the table and the worst cell; with ``write`` (``--write-results``), put
    ``section()`` in RESULTS.md in place of the ``title`` section. Returns 0."""
    for line in lines:
        print(line)
    print(worst)
    if write:
        write_section(title, section())
    return 0
