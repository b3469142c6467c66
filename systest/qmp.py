"""qemu's machine protocol (QMP) on the socket :mod:`systest.vm` gives qemu: the power cut.

Owns the one thing the systest asks of a running qemu besides its console: a hard reset
of the guest (``system_reset``: the machine restarts at once, no shutdown, whatever the
guest had not written yet lost), which the faults steps ask for (``make systest-faults``).
qemu runs with ``-no-reboot`` (a guest that reboots by itself ends the run), which
turns a reset into a shutdown, so the reboot action is ``reset`` for the cut and
``shutdown`` again right after (``set-action``, qemu >= 6.0; the reset is decided when
it is asked). The disk's ``-snapshot`` overlay lives as long as the qemu process: what
the guest wrote reaches the next boot.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, BinaryIO


class QmpError(Exception):
    """The monitor could not be reached or refused a command."""


def _call(f: BinaryIO, sock: socket.socket, command: str, **arguments: Any) -> Any:
    """Send one command; its ``return`` (asynchronous events in between are skipped)."""
    msg: dict[str, Any] = {"execute": command}
    if arguments:
        msg["arguments"] = arguments
    sock.sendall(json.dumps(msg).encode() + b"\r\n")
    while True:
        line = f.readline()
        if not line:
            raise QmpError(f"{command}: qemu closed the monitor")
        reply = json.loads(line)
        if "return" in reply:
            return reply["return"]
        if "error" in reply:
            raise QmpError(f"{command}: {reply['error'].get('desc', reply['error'])}")


def power_cut(path: Path, timeout_s: float = 30.0) -> None:
    """Reset the guest now, as a power cut would (see the module docstring)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(path))
            with sock.makefile("rb") as f:
                greeting = json.loads(f.readline() or b"{}")
                if "QMP" not in greeting:
                    raise QmpError(f"not a QMP greeting: {greeting}")
                _call(f, sock, "qmp_capabilities")
                _call(f, sock, "set-action", reboot="reset")
                _call(f, sock, "system_reset")
                _call(f, sock, "set-action", reboot="shutdown")
    except (OSError, ValueError) as err:
        raise QmpError(f"{path}: {err}") from err
