"""sd_notify(3) without libsystemd: READY, STATUS, WATCHDOG, STOPPING.

Owns sending datagrams to ``$NOTIFY_SOCKET`` (a path, or an abstract socket
when it starts with ``@``) and reading the watchdog interval from
``$WATCHDOG_USEC`` / ``$WATCHDOG_PID``. Outside systemd every call is a no-op
returning False. The watchdog ping must come from the event loop that serves
requests, so a hung front stops pinging and systemd restarts it.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


def _address(env: Mapping[str, str]) -> str | None:
    addr = env.get("NOTIFY_SOCKET")
    if not addr:
        return None
    return "\0" + addr[1:] if addr.startswith("@") else addr


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1\\nSTATUS=serving"``); False when not under systemd."""
    addr = _address(os.environ if env is None else env)
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            # Never block the event loop: a full receiver queue drops this message.
            sock.setblocking(False)
            sock.connect(addr)
            sock.send(state.encode("utf-8"))
    except BlockingIOError:
        log.warning("sd_notify to %s: receiver queue full, dropped %r", addr.lstrip("\0"), state)
        return False
    except OSError as err:
        log.warning("sd_notify to %s failed: %s", addr.lstrip("\0"), err)
        return False
    return True


def watchdog_interval_s(env: Mapping[str, str] | None = None) -> float | None:
    """How often to send WATCHDOG=1 (half of WatchdogSec), or None when not asked."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2_000_000 if value > 0 else None


def ready(status: str) -> bool:
    return notify(f"READY=1\nSTATUS={status}")


def status(text: str) -> bool:
    return notify(f"STATUS={text}")


def watchdog() -> bool:
    return notify("WATCHDOG=1")


def stopping(text: str = "stopping") -> bool:
    return notify(f"STOPPING=1\nSTATUS={text}")
