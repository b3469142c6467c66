"""Alert delivery: a JSON-lines log, and optionally a webhook and a command.

Owns the alert record's JSON form (one object per line in
``<state_dir>/alerts.jsonl``)::

    {"time": "2026-11-30T05:40:01Z", "host": "board", "severity": "critical",
     "kind": "oom-kill", "message": "...", "facts": {...}}

and its delivery. The log write comes first, as one ``write(2)`` of the whole line;
a failure raises (the watcher must not run blind), except a full filesystem (ENOSPC,
EDQUOT): then the alert goes to the watcher's own log (stderr: the journal) at its
severity, whatever part of the line was written is cut off again (no torn line for the
next one to be glued to), the failure is counted and the next alert tries the file
again. The log is private, as the crash bundles are: 0600 whatever the umask (an older
one made 0644 is narrowed at the next write), a new directory for it 0700, and a link in
its place is refused (the state directory may be shared). The webhook (HTTP POST of the
same JSON, short timeout) and the command (run without a shell, the JSON on stdin, and
``SLMGUARD_ALERT_SEVERITY`` / ``_KIND`` / ``_MESSAGE`` in its environment) are best
effort (:mod:`slmguard.watch.client`): a failure is logged and counted, never raised, so
a dead webhook cannot stop the watchdog.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shlex
import socket
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slmguard.errors import HostReadError
from slmguard.watch import client
from slmguard.watch.bundle import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE
from slmguard.watch.rules import Alert

log = logging.getLogger(__name__)


def alert_record(alert: Alert, unix_s: float | None = None) -> dict[str, Any]:
    when = time.gmtime(time.time() if unix_s is None else unix_s)
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", when),
        "host": socket.gethostname(),
        "severity": alert.severity,
        "kind": alert.kind,
        "message": alert.message,
        "facts": dict(alert.facts),
    }


@dataclass(frozen=True)
class Delivery:
    """What happened to one alert beyond the log."""

    webhook_status: int | None = None
    webhook_error: str | None = None
    command_exit: int | None = None
    command_error: str | None = None


#: A full filesystem: the alert goes to the journal instead, and the watcher goes on.
_FULL = (errno.ENOSPC, errno.EDQUOT)


def _append_line(path: Path, data: bytes) -> None:
    """Append ``data`` in one write, the file made 0600 (narrowed when it was more open; a
    link in its place is refused: ELOOP); on failure cut the file back to where it was."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    try:
        st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) != PRIVATE_FILE_MODE:
            os.fchmod(fd, PRIVATE_FILE_MODE)
        before = st.st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, before)
            raise
    finally:
        os.close(fd)


@dataclass
class AlertSink:
    log_path: Path
    webhook_url: str | None = None
    command: str | None = None
    timeout_s: float = 5.0
    failures: int = 0
    log_failures: int = 0  # alerts the full filesystem kept out of the log (journal only)

    def emit(self, alert: Alert, unix_s: float | None = None) -> Delivery:
        record = alert_record(alert, unix_s)
        line = json.dumps(record, sort_keys=True, default=str)
        level = logging.WARNING if alert.severity != "info" else logging.INFO
        try:
            self.log_path.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
            _append_line(self.log_path, (line + "\n").encode("utf-8"))
        except OSError as err:
            if err.errno not in _FULL:
                raise HostReadError(self.log_path, f"cannot append alert: {err.strerror}") from err
            self.log_failures += 1
            log.log(
                logging.ERROR if alert.severity == "critical" else logging.WARNING,
                "alert %s %s: %s (not in %s: %s) %s",
                alert.severity, alert.kind, alert.message, self.log_path, err.strerror, line,
            )  # fmt: skip
        else:
            log.log(level, "alert %s %s: %s", alert.severity, alert.kind, alert.message)
        status = error = None
        if self.webhook_url:
            status, error = self._post(line)
        exit_code = cmd_error = None
        if self.command:
            exit_code, cmd_error = self._run(line, alert)
        return Delivery(status, error, exit_code, cmd_error)

    def _post(self, body: str) -> tuple[int | None, str | None]:
        assert self.webhook_url is not None  # checked by the caller
        try:
            status, _ = client.request(
                self.webhook_url, method="POST", body=body.encode("utf-8"), timeout_s=self.timeout_s
            )
        except (OSError, ValueError) as err:
            self.failures += 1
            log.warning("webhook %s failed: %s", self.webhook_url, err)
            return None, str(err) or type(err).__name__
        if not 200 <= status < 300:
            self.failures += 1
            log.warning("webhook %s answered HTTP %s", self.webhook_url, status)
            return status, f"HTTP {status}"
        return status, None

    def _run(self, body: str, alert: Alert) -> tuple[int | None, str | None]:
        assert self.command is not None  # checked by the caller
        env = dict(os.environ)
        env.update(
            SLMGUARD_ALERT_SEVERITY=alert.severity,
            SLMGUARD_ALERT_KIND=alert.kind,
            SLMGUARD_ALERT_MESSAGE=alert.message,
        )
        try:
            done = subprocess.run(
                shlex.split(self.command),
                input=body + "\n",
                text=True,
                env=env,
                capture_output=True,
                timeout=max(self.timeout_s, 10.0),
                check=False,
            )
        except (OSError, ValueError, subprocess.TimeoutExpired) as err:
            self.failures += 1
            log.warning("alert command %r failed: %s", self.command, err)
            return None, str(err)
        if done.returncode != 0:
            self.failures += 1
            log.warning(
                "alert command %r exited %s: %s",
                self.command,
                done.returncode,
                done.stderr.strip()[:200],
            )
        return done.returncode, None
