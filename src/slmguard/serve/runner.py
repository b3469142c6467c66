"""Run one server: supervisor, uvicorn, sd_notify, fault logs, shutdown.

Owns the process-level lifecycle of ``slmguard serve`` (the CLI module only
parses and reports): enable ``faulthandler`` into ``<state_dir>/faults/
front.log``, lower the front's ``oom_score_adj``, bind the listening socket
(so a busy port is a clear error, not uvicorn's exit), start the worker, tell
systemd READY once the engine is loaded, ping the watchdog from the event
loop, and stop everything on SIGTERM/SIGINT (uvicorn captures them and
drains in-flight requests for ``shutdown_grace_s``).
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
from slmguard.serve.app import ServeContext, create_app
from slmguard.serve.supervisor import set_own_oom_score_adj

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


async def _watchdog(interval_s: float) -> None:
    while True:
        notify.watchdog()
        await asyncio.sleep(interval_s)


def _quiet_exit_server(base: Any) -> Any:
    """uvicorn's Server without re-raising SIGTERM/SIGINT after its graceful shutdown.

    uvicorn (>= 0.29) re-raises the captured signal once it has drained, which
    kills the process before our own shutdown (governor, worker, STOPPING=1)
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
    """Serve until stopped. Returns 0, or raises EngineError when the worker kept dying."""
    import uvicorn

    app = create_app(ctx)
    config = uvicorn.Config(
        app,
        log_level=logging.getLogger().getEffectiveLevel(),
        access_log=False,
        timeout_graceful_shutdown=int(ctx.settings.shutdown_grace_s),
        lifespan="off",
    )
    server = _quiet_exit_server(uvicorn.Server)(config)
    sup = ctx.supervisor
    announced = False

    def on_state(state: str) -> None:
        nonlocal announced
        ctx.metrics.set_state(ctx.state)
        text = f"engine {state}; model {ctx.model_id}; n_ctx {sup.n_ctx}"
        if state == "ready" and not announced:
            announced = True
            notify.ready(text)
        else:
            notify.status(text)

    def on_failed() -> None:
        server.should_exit = True

    sup.on_state = on_state
    sup.on_failed = on_failed
    sup.on_restart = ctx.metrics.worker_restarts.inc
    sup.on_cancelled = ctx.metrics.generation_cancelled
    ctx.metrics.set_state(ctx.state)
    tasks: list[asyncio.Task[Any]] = []
    interval = notify.watchdog_interval_s()
    if interval:
        # Pinged from the start, not only after READY: the model loads in the
        # worker while this loop runs, so a slow load does not trip WatchdogSec.
        notify.watchdog()
        tasks.append(asyncio.create_task(_watchdog(interval)))
    await sup.start()
    if companion is not None:
        companion.start()
    try:
        await server.serve(sockets=[sock])
    finally:
        notify.stopping()
        for t in tasks:
            t.cancel()
        if companion is not None:
            await companion.aclose()
        await sup.stop()
    if sup.state == "failed" or ctx.state == "failed":
        raise EngineError(
            f"the engine worker died {sup.restarts} times within "
            f"{sup.policy.window_s:.0f} s; giving up",
            hint=f"see the log and {ctx.settings.state_dir}/faults/worker.log",
        )
    return 0


def run(ctx: ServeContext, sock: socket.socket, companion: Lifecycle | None = None) -> int:
    set_own_oom_score_adj(ctx.settings.front_oom_score_adj)
    with contextlib.closing(sock):
        return asyncio.run(serve(ctx, sock, companion))
