"""A real server with the governor installed, run in a thread of the test process.

Builds the server the way ``slmguard serve`` does (ServeContext, the real
llama-server engine child and the default model), installs the governor
with :func:`slmguard.governor.serving.install`, starts its loop in the
server's event loop, and serves on a free loopback port with uvicorn: what
``slmguard serve`` builds, in process, so tests can reach the governor object
and set its timings. Used by ``test_governor_http.py`` and
``benchmarks/governor.py``.

Example::

    with governed_server(tmp_path, n_ctx=1024) as srv:
        httpx.get(srv.url + "/api/v1/governor", headers=srv.admin_headers())
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slmguard import paths
from slmguard.default_model import ensure_default_model
from slmguard.governor.policy import DegradeSettings
from slmguard.governor.runtime import Governor
from slmguard.governor.serving import build_governor, install
from slmguard.plan.modelfacts import read_model_facts

MODEL_ID = "gemma-3-270m-q4_k_m"


@dataclass
class GovernedServer:
    url: str
    governor: Governor
    ctx: Any  # slmguard.serve.context.ServeContext
    api_key: str | None
    admin_token: str | None
    loop: asyncio.AbstractEventLoop

    def api_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the server's event loop thread and return its result."""
        done: asyncio.Future[Any] = asyncio.run_coroutine_threadsafe(_call(fn), self.loop)
        return done.result(timeout=60)


async def _call(fn: Callable[[], Any]) -> Any:
    result = fn()
    if asyncio.iscoroutine(result):
        return await result
    return result


def _free_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


@contextlib.contextmanager
def governed_server(
    state_dir: Path,
    *,
    n_ctx: int = 1024,
    api_key: str | None = "test-api-key",
    admin_token: str | None = "test-admin-token",
    budget_bytes: int | None = None,
    recover_hold_s: float = 1.0,
    enabled: bool = True,
    queue_size: int = 4,
    retry_after_s: int = 1,
    degrade: DegradeSettings | None = None,
    n_parallel: int = 1,
) -> Iterator[GovernedServer]:
    import tempfile

    import uvicorn

    from slmguard.serve.app import create_app
    from slmguard.serve.context import ServeContext, ServedModel
    from slmguard.serve.engine import EngineProcess, RestartPolicy
    from slmguard.serve.llamaserver import EngineConfig, engine_version, find_llama_server
    from slmguard.serve.queue import SlotQueue
    from slmguard.serve.sessions import FILENAME, SessionService, SessionStore
    from slmguard.settings import ServeSettings

    model_path = ensure_default_model(paths.model_dir())
    facts = read_model_facts(model_path)
    settings = ServeSettings(
        n_ctx=n_ctx, queue_size=queue_size, retry_after_s=retry_after_s, state_dir=state_dir,
        n_parallel=n_parallel,
    )  # fmt: skip
    config = EngineConfig(
        model_path=str(model_path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=2,
        n_parallel=n_parallel,
    )  # fmt: skip
    binary = find_llama_server()
    engine = EngineProcess(
        binary, config, RestartPolicy(), alias=MODEL_ID,
        runtime_dir=Path(tempfile.mkdtemp(prefix="slmguard-gov-")),
    )  # fmt: skip
    ctx = ServeContext(
        settings=settings,
        engine=engine,
        queue=SlotQueue(n_parallel, queue_size),
        model=ServedModel(MODEL_ID, str(model_path), facts.file_bytes, arch=facts.arch),
        engine_version=engine_version(binary),
        sessions=SessionService(SessionStore.open(state_dir / FILENAME)),
        api_key=api_key,
        admin_token=admin_token,
    )
    governor = build_governor(
        ctx,
        plan=None,
        facts=facts,
        state_dir=state_dir,
        budget_bytes=budget_bytes,
        enabled=enabled,
        recover_hold_s=recover_hold_s,
        degrade=degrade,
    )
    install(ctx, governor)
    app = create_app(ctx)
    sock = _free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    )
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def on_state(state: str) -> None:
        ctx.queue.resize(engine.config.n_parallel)
        ctx.metrics.set_state(ctx.state)

    engine.on_state = on_state
    engine.on_restart = ctx.metrics.engine_restarts.inc

    async def main() -> None:
        await engine.start()
        governor.start()
        ready.set()
        try:
            await server.serve(sockets=[sock])
        finally:
            await governor.aclose()
            await engine.stop()
            ctx.sessions.close()  # type: ignore[union-attr]

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("server thread did not start")
        up = asyncio.run_coroutine_threadsafe(engine.wait_ready(120), loop).result(130)
        if not up:
            raise RuntimeError(f"engine never became ready (state {engine.state})")
        yield GovernedServer(f"http://127.0.0.1:{port}", governor, ctx, api_key, admin_token, loop)
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        loop.close()
