"""The process around one server: the listening socket, uvicorn, sd_notify, fault logs.

Owns what :class:`slmguard.serve.server.Server` needs from the process and
from uvicorn, and nothing about requests: bind the listening socket (so a busy
port is a clear error, not uvicorn's exit), enable ``faulthandler`` into
``<state_dir>/faults/front.log``, uvicorn's server that leaves SIGTERM/SIGINT
to our own shutdown, and the systemd watchdog pinger.

Slow clients: uvicorn times out idle keep-alive connections but not a client
that never finishes its request headers; :func:`timed_protocol` closes a
connection whose headers have not all arrived within ``header_timeout_s``
(the body's own timeout is the app's ``BodyLimit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from slmguard import notify
from slmguard.errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")


def open_fault_log(path: Path) -> IO[str] | None:
    """Enable faulthandler into ``path`` (append, 0600); None (logged) when not writable.
    Its directory and the one above (the state directory) are made 0700 when made here."""
    try:
        path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        f = os.fdopen(fd, "a")
    except OSError as err:
        log.warning("cannot open fault log %s: %s", path, err.strerror)
        return None
    faulthandler.enable(file=f)
    return f


#: The most request-line and header bytes a connection may send before its headers end
#: (h11's own default; httptools keeps every header it is given).
HEADER_BYTES_MAX = 16 * 1024


def http_protocol() -> Any:
    """uvicorn's HTTP/1.1 protocol class: httptools' (a C parser, and a plain chunked
    writer for a relayed stream) when it is installed, else h11's."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools is not installed (an exotic platform, no wheel)
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    return HttpToolsProtocol


def timed_protocol(header_timeout_s: float, base: Any = None) -> Any:
    """``base`` (default :func:`http_protocol`), closing a connection whose request
    headers stay incomplete for ``header_timeout_s`` or grow past
    :data:`HEADER_BYTES_MAX` before they end."""
    base = base or http_protocol()

    class TimedProtocol(base):  # type: ignore[misc]
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_bytes = 0
                self._header_timer = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _waiting(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _expire(self) -> None:
            self._header_timer = None
            if self._waiting() and not self.transport.is_closing():
                log.info("closing a connection whose request headers did not arrive in %.0f s",
                         header_timeout_s)  # fmt: skip
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            waiting = self._waiting()
            if waiting:
                self._arm()
            super().data_received(data)
            if not self._waiting():
                self._disarm()  # the headers are in: a request is being handled
            elif waiting and not self.transport.is_closing():
                # Still no end of headers: what the parser holds is bounded (one read,
                # at most, beyond the limit).
                self._header_bytes += len(data)
                if self._header_bytes > HEADER_BYTES_MAX:
                    self._too_large()

        def _too_large(self) -> None:
            log.info("closing a connection whose request headers passed %d bytes",
                     HEADER_BYTES_MAX)  # fmt: skip
            self._disarm()
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-length: 0\r\nconnection: close\r\n\r\n"
            )
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedProtocol


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end on uvloop's event loop (libuv: a read and a write cost
    a fraction of asyncio's selector loop, which a relayed token pays), or on asyncio's
    where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def stack_name() -> str:
    """What serves HTTP here, for the start-up log: the parser and the event loop."""
    parser = "httptools" if "HttpTools" in http_protocol().__name__ else "h11"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return f"{parser} on asyncio"
    return f"{parser} on uvloop"


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {err.strerror}",
            hint="choose another --port or stop the process using it",
        ) from err
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def start_watchdog(ok: Callable[[], bool]) -> asyncio.Task[None] | None:
    """Feed systemd's watchdog from this loop while ``ok()`` (None without WatchdogSec).

    Pinged from the start, not only after READY: the model loads in the engine
    while this loop runs, so a slow load does not trip WatchdogSec.
    """
    interval = notify.watchdog_interval_s()
    if not interval:
        return None
    notify.watchdog()

    async def feed() -> None:
        while True:
            if ok():
                notify.watchdog()
            await asyncio.sleep(interval)

    return asyncio.create_task(feed(), name="watchdog")


def quiet_exit_server(base: Any) -> Any:
    """uvicorn's Server without re-raising SIGTERM/SIGINT after its graceful shutdown,
    and without waking ten times a second to see whether it should exit.

    uvicorn (>= 0.29) re-raises the captured signal once it has drained, which
    kills the process before our own shutdown (governor, engine, STOPPING=1)
    runs. Here the signal only asks uvicorn to exit; ``serve`` returns and the
    process exits 0 after cleaning up.
    """

    class Server(base):  # type: ignore[misc]
        # uvicorn's main loop wakes every 0.1 s to see whether it should exit: ten
        # wake-ups a second of an idle server, each taken from the engine's threads on a
        # 2-core board. Here it wakes once a second (the Date header's resolution), and
        # at once when asked to exit (a signal or the server itself).
        _wake: asyncio.Event | None = None
        _loop: asyncio.AbstractEventLoop | None = None
        _exit = False

        @property
        def should_exit(self) -> bool:
            return self._exit

        @should_exit.setter
        def should_exit(self, value: bool) -> None:
            self._exit = value
            if value and self._wake is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(self._wake.set)

        async def main_loop(self) -> None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            counter = 0
            while not await self.on_tick(counter):
                counter = (counter + 10) % 864000  # each tick refreshes the Date header
                with contextlib.suppress(asyncio.exceptions.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 1.0)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)
                if self._captured_signals:
                    log.warning("stopped by %s", signal.Signals(self._captured_signals[0]).name)

    return Server
