"""qemu's machine protocol (QMP) on the socket :mod:`systest.vm` gives qemu: the power cut.

Owns the one thing the systest asks of a running qemu besides its console: a hard reset
of the guest (``system_reset``: the machine restarts at once, no shutdown, whatever the
guest had not written yet lost), which the faults steps ask for (``make systest-faults``).
qemu runs with ``-no-reboot`` (a guest that reboots by itself ends the run), which
turns a reset into a shutdown, so the reboot action is ``reset`` for the cut and until
the guest runs its scenario again (the firmware resets the machine a second time), then
``shutdown`` again (``set-action``, qemu >= 6.0). The disk's ``-snapshot`` overlay lives
as long as the qemu process: what the guest wrote reaches the next boot.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, BinaryIO


class QmpError(Exception):
    """The monitor could not be reached or refused a command."""


def _call(
    f: BinaryIO,
    sock: socket.socket,
    command: str,
    events: list[str] | None = None,
    **arguments: Any,
) -> Any:
    """Send one command; its ``return`` (asynchronous events in between go to ``events``)."""
    msg: dict[str, Any] = {"execute": command}
    if arguments:
        msg["arguments"] = arguments
    sock.sendall(json.dumps(msg).encode() + b"\r\n")
    while True:
        reply = _line(f, command)
        if "return" in reply:
            return reply["return"]
        if "error" in reply:
            raise QmpError(f"{command}: {reply['error'].get('desc', reply['error'])}")
        if events is not None and "event" in reply:
            events.append(str(reply["event"]))


def _line(f: BinaryIO, waiting_for: str) -> dict[str, Any]:
    line = f.readline()
    if not line:
        raise QmpError(f"{waiting_for}: qemu closed the monitor")
    reply = json.loads(line)
    return reply if isinstance(reply, dict) else {}


def _await_reset(f: BinaryIO, events: list[str]) -> None:
    """Until qemu reports the reset done (its ``RESET`` event); a ``SHUTDOWN`` instead is
    a power cut that ended qemu (and the run with it)."""
    while True:
        if "RESET" in events:
            return
        if "SHUTDOWN" in events:
            raise QmpError("system_reset: qemu shut the machine down instead of resetting it")
        reply = _line(f, "the RESET event")
        if "event" in reply:
            events.append(str(reply["event"]))


def _session(path: Path, timeout_s: float, *commands: tuple[str, dict[str, Any]]) -> list[str]:
    """Run ``commands`` on the monitor; the events seen meanwhile."""
    events: list[str] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(path))
            with sock.makefile("rb") as f:
                greeting = json.loads(f.readline() or b"{}")
                if "QMP" not in greeting:
                    raise QmpError(f"not a QMP greeting: {greeting}")
                _call(f, sock, "qmp_capabilities")
                for command, arguments in commands:
                    _call(f, sock, command, events, **arguments)
                    if command == "system_reset":
                        _await_reset(f, events)
    except (OSError, ValueError) as err:
        raise QmpError(f"{path}: {err}") from err
    return events


def power_cut(path: Path, timeout_s: float = 30.0) -> None:
    """Reset the guest now, as a power cut would (see the module docstring), and wait for
    qemu's ``RESET`` event. The reboot action stays ``reset``: SeaBIOS answers a warm reset
    by restoring its own image and resetting the machine once more (``qemu_reboot`` in its
    ``resume.c``), which ``shutdown`` would turn into the end of qemu. The caller puts it
    back with :func:`reboots_end_qemu` once the guest runs again."""
    _session(path, timeout_s, ("set-action", {"reboot": "reset"}), ("system_reset", {}))


def reboots_end_qemu(path: Path, timeout_s: float = 30.0) -> None:
    """``-no-reboot`` again: a reboot the guest asks for ends qemu (and the run)."""
    _session(path, timeout_s, ("set-action", {"reboot": "shutdown"}))
