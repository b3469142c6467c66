"""The fleet report: after each playbook run, one JSON line per board the run reached.

An Ansible callback plugin shipped in the rendered tree (``callback_plugins/``
beside the playbooks, enabled by its ``ansible.cfg``); Ansible runs it on the
controller, slmguard never imports it. It keeps, per board, the last
``slmguard_report`` fact the role set (the rollout; the plan's sha256 and the
rollout before and after; the gate's result; the bytes the board took from
the mirror, the controller and the packages), whether a task failed (the first,
and its message) or the board became unreachable, and the seconds from its
first task to its last result. At the end it writes them to
``reports/<UTC time>-<playbook>.jsonl`` beside the playbook (or
``$SLMGUARD_FLEET_REPORT_DIR``), one line per board in name order, for diffing
and monitoring, and names the file. Nothing in it is secret: the role sets no
key or token in the fact.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ansible.plugins.callback import CallbackBase  # type: ignore[import-untyped, unused-ignore]

DOCUMENTATION = """
    name: slmguard_report
    type: aggregate
    short_description: one JSON line per board after each run (slmguard's fleet report)
    description:
      - The role's slmguard_report fact per board, its failure or unreachability, seconds.
"""

SCHEMA = "slmguard.fleet-report/1"
_MESSAGE_CHARS = 300
#: The role's keys every line carries: None where the run stopped before it learned them (a
#: board refused at ``slmguard stage``, or unreachable from the start), so lines diff alike.
_KEYS = ("rollout", "plan_before", "plan_after", "rollout_before", "rollout_after")


class CallbackModule(CallbackBase):  # type: ignore[misc, unused-ignore]
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "slmguard_report"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self.boards: dict[str, dict[str, Any]] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.task_started = time.monotonic()
        self.playbook = "playbook"
        self.basedir = Path.cwd()

    def v2_playbook_on_start(self, playbook: Any) -> None:
        self.playbook = Path(str(playbook._file_name)).stem
        self.basedir = Path(str(playbook._basedir))

    def v2_playbook_on_task_start(self, task: Any, is_conditional: bool) -> None:
        self.task_started = time.monotonic()

    def _board(self, result: Any) -> dict[str, Any]:
        name = str(result._host.get_name())
        now = time.monotonic()
        self.first.setdefault(name, self.task_started)
        self.last[name] = now
        return self.boards.setdefault(name, {})

    def v2_runner_on_ok(self, result: Any) -> None:
        board = self._board(result)
        facts = result._result.get("ansible_facts") or {}
        report = facts.get("slmguard_report")
        if isinstance(report, dict):
            board["report"] = dict(report)

    def v2_runner_on_failed(self, result: Any, ignore_errors: bool = False) -> None:
        board = self._board(result)
        if not ignore_errors and "failed_task" not in board:  # the first: the cause
            board["failed_task"] = str(result._task.get_name())
            board["message"] = str(result._result.get("msg", ""))[:_MESSAGE_CHARS]

    def v2_runner_on_skipped(self, result: Any) -> None:
        self._board(result)

    def v2_runner_on_unreachable(self, result: Any) -> None:
        board = self._board(result)
        board["unreachable"] = True
        board["failed_task"] = str(result._task.get_name())
        board["message"] = str(result._result.get("msg", ""))[:_MESSAGE_CHARS]

    def _line(self, name: str, board: dict[str, Any]) -> dict[str, Any]:
        report = dict(board.get("report", {}))
        moved = report.pop("bytes_moved", {}) or {}
        moved = {k: int(v or 0) for k, v in moved.items()}
        if board.get("unreachable"):
            result = "unreachable"
        elif "failed_task" in board:
            result = "rolled back" if report.get("rolled_back") in (True, "True") else "failed"
        else:
            result = "changed" if report.get("changed") in (True, "True") else "unchanged"
        gate = report.pop("gate", "not run")
        if board.get("unreachable") and gate == "running":
            gate = "unknown"
        return {
            "schema": SCHEMA,
            "board": name,
            "playbook": self.playbook,
            "result": result,
            **dict.fromkeys(_KEYS),
            "changed": False,
            "rolled_back": False,
            **report,
            "gate": gate,
            "failed_task": board.get("failed_task"),
            "message": board.get("message"),
            "bytes_moved": moved,
            "bytes_moved_total": sum(moved.values()),
            "seconds": round(self.last.get(name, 0) - self.first.get(name, 0), 3),
        }

    def v2_playbook_on_stats(self, stats: Any) -> None:
        if not self.boards:
            return
        directory = Path(os.environ.get("SLMGUARD_FLEET_REPORT_DIR") or self.basedir / "reports")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        path = directory / f"{stamp}-{self.playbook}.jsonl"
        lines = [
            json.dumps(self._line(n, b), sort_keys=True) for n, b in sorted(self.boards.items())
        ]
        try:
            directory.mkdir(parents=True, exist_ok=True)
            n = 1
            while path.exists():  # two runs in one second
                n += 1
                path = directory / f"{stamp}-{n}-{self.playbook}.jsonl"
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        except OSError as err:
            self._display.warning(f"slmguard fleet report not written to {path}: {err}")
            return
        self._display.display(f"slmguard fleet report: {path} ({len(lines)} boards)")
