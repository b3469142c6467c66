"""Run one server: the engine child, uvicorn, sd_notify, fault logs, shutdown.

Owns the process-level lifecycle of ``slmguard serve`` (the CLI module only
parses and reports): enable ``faulthandler`` into ``<state_dir>/faults/
front.log``, lower the front's ``oom_score_adj``, bind the listening socket
(so a busy port is a clear error, not uvicorn's exit), start the engine, tell
systemd READY once the engine is loaded, ping the watchdog from the event
loop, and stop everything on SIGTERM/SIGINT (uvicorn captures them and
drains in-flight requests for ``shutdown_grace_s``).

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
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol

from slmguard import notify
from slmguard.errors import ConfigError, EngineError
from slmguard.host.process import set_oom_score_adj
from slmguard.serve.app import create_app
from slmguard.serve.context import ServeContext

log = logging.getLogger(__name__)


def open_fault_log(path: Path) -> IO[str] | None:
    """Enable faulthandler into ``path`` (append); None (logged) when not writable."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = path.open("a")
    except OSError as err:
        log.warning("cannot open fault log %s: %s", path, err.strerror)
        return None
    faulthandler.enable(file=f)
    return f


def timed_protocol(header_timeout_s: float) -> Any:
    """uvicorn's h11 protocol, closing connections whose request headers stay incomplete."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                log.info("closing a connection whose request headers did not arrive in %.0f s",
                         header_timeout_s)  # fmt: skip
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:
                self._arm()
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # the headers are in: a request is being handled

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedH11Protocol


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


async def _watchdog(interval_s: float, ok: Any) -> None:
    """Feed systemd's watchdog from this loop while ``ok()`` says the engine is alive."""
    while True:
        if ok():
            notify.watchdog()
        await asyncio.sleep(interval_s)


def _quiet_exit_server(base: Any) -> Any:
    """uvicorn's Server without re-raising SIGTERM/SIGINT after its graceful shutdown.

    uvicorn (>= 0.29) re-raises the captured signal once it has drained, which
    kills the process before our own shutdown (governor, engine, STOPPING=1)
    runs. Here the signal only asks uvicorn to exit; ``serve`` returns and the
    process exits 0 after cleaning up.
    """

    class Server(base):  # type: ignore[misc]
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


class Lifecycle(Protocol):
    """Something that runs beside the server (the governor): started and closed with it."""

    def start(self) -> Any: ...

    async def aclose(self) -> None: ...


async def serve(ctx: ServeContext, sock: socket.socket, companion: Lifecycle | None = None) -> int:
    """Serve until stopped. Returns 0, or raises EngineError when the engine kept dying."""
    import uvicorn

    app = create_app(ctx)
    config = uvicorn.Config(
        app,
        log_level=logging.getLogger().getEffectiveLevel(),
        access_log=False,
        timeout_graceful_shutdown=int(ctx.settings.shutdown_grace_s),
        lifespan="off",
        http=timed_protocol(ctx.settings.header_timeout_s),
    )
    server = _quiet_exit_server(uvicorn.Server)(config)
    engine = ctx.engine
    _follow_engine(ctx, server)
    ctx.metrics.set_state(ctx.state)
    tasks = _start_watchdog(ctx)
    await engine.start()
    liveness = ctx.liveness
    if liveness is not None:
        liveness.start()
    if companion is not None:
        companion.start()
    try:
        await server.serve(sockets=[sock])
    finally:
        notify.stopping()
        for t in tasks:
            t.cancel()
        if liveness is not None:
            await liveness.aclose()
        if companion is not None:
            await companion.aclose()
        await engine.stop()
        if ctx.sessions is not None:
            ctx.sessions.close()
    if engine.load_error is not None:
        raise engine.load_error
    if engine.state == "failed":
        raise EngineError(
            f"the engine died {engine.restarts} times within "
            f"{engine.policy.window_s:.0f} s; giving up",
            hint="see the engine's log lines above (logger slmguard.engine)",
        )
    return 0


def _follow_engine(ctx: ServeContext, server: Any) -> None:
    """The engine's callbacks: metrics, queue size and sd_notify on each state (READY
    the first time it is ready), the server stopped once it failed for good."""
    engine = ctx.engine
    announced = False

    def on_state(state: str) -> None:
        nonlocal announced
        ctx.metrics.set_state(ctx.state)
        ctx.queue.resize(engine.config.n_parallel)
        text = f"engine {state}; model {ctx.model_id}; n_ctx {engine.config.n_ctx_slot}"
        if state == "ready" and not announced:
            announced = True
            notify.ready(text)
        else:
            notify.status(text)

    def on_failed() -> None:
        server.should_exit = True

    engine.on_state = on_state
    engine.on_failed = on_failed
    engine.on_restart = ctx.metrics.engine_restarts.inc


def _start_watchdog(ctx: ServeContext) -> list[asyncio.Task[Any]]:
    """The systemd watchdog pinger, when WatchdogSec is set (else no task)."""
    interval = notify.watchdog_interval_s()
    if not interval:
        return []
    # Pinged from the start, not only after READY: the model loads in the
    # engine while this loop runs, so a slow load does not trip WatchdogSec.
    # Not while the engine is stuck or has failed for good (Liveness.watchdog_ok).
    notify.watchdog()
    engine, liveness = ctx.engine, ctx.liveness
    ok = liveness.watchdog_ok if liveness is not None else (lambda: engine.state != "failed")
    return [asyncio.create_task(_watchdog(interval, ok))]


def run(ctx: ServeContext, sock: socket.socket, companion: Lifecycle | None = None) -> int:
    set_oom_score_adj(ctx.settings.front_oom_score_adj, who="the front")
    with contextlib.closing(sock):
        return asyncio.run(serve(ctx, sock, companion))
