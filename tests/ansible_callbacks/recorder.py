"""A stdout callback for the tests: every task's result per host, and the stats, as one JSON.

Each task carries ``started_s`` (seconds since the playbook started) and each host's
result ``took_s`` (from the task's start to that host's result): where a slow run
spent its time.

ansible-core ships no JSON callback (``json`` is in the ansible.posix
collection, which the tests do not download). Enabled with
``ANSIBLE_CALLBACK_PLUGINS=tests/ansible_callbacks ANSIBLE_STDOUT_CALLBACK=recorder``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
    name: recorder
    type: stdout
    short_description: task results and stats as one JSON document (slmguard's tests)
    description: [Every task result per host and the final stats, printed at the end.]
"""


class CallbackModule(CallbackBase):  # type: ignore[misc]
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.plays: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def v2_playbook_on_play_start(self, play: Any) -> None:
        self.plays.append({"play": {"name": play.get_name()}, "tasks": []})

    def _start(self, task: Any) -> None:
        started = round(time.monotonic() - self.t0, 3)
        self.plays[-1]["tasks"].append(
            {"task": {"name": task.get_name()}, "hosts": {}, "started_s": started}
        )

    def v2_playbook_on_task_start(self, task: Any, is_conditional: bool) -> None:
        self._start(task)

    def v2_playbook_on_handler_task_start(self, task: Any) -> None:
        self._start(task)

    def _record(self, result: Any, **status: bool) -> None:
        data = dict(result._result)
        data.update(status)
        # Results of the same task name (a task and a handler) go to the last one started.
        for task in reversed(self.plays[-1]["tasks"]):
            if task["task"]["name"] == result._task.get_name():
                data["took_s"] = round(time.monotonic() - self.t0 - task["started_s"], 3)
                task["hosts"][result._host.get_name()] = data
                return

    def v2_runner_on_ok(self, result: Any) -> None:
        self._record(result)

    def v2_runner_on_failed(self, result: Any, ignore_errors: bool = False) -> None:
        self._record(result, failed=True)

    def v2_runner_on_skipped(self, result: Any) -> None:
        self._record(result, skipped=True)

    def v2_runner_on_unreachable(self, result: Any) -> None:
        self._record(result, unreachable=True)

    def v2_playbook_on_stats(self, stats: Any) -> None:
        summary = {h: stats.summarize(h) for h in sorted(stats.processed)}
        json.dump({"plays": self.plays, "stats": summary}, sys.stdout, default=str)
        sys.stdout.write("\n")
