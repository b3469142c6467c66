"""A real server with the governor, run in a thread of the test process.

Built by :func:`slmguard.serve.server.build_server`, the function ``slmguard
serve`` builds its server with (the real llama-server engine child and the
default model), and served on a free loopback port by
:meth:`~slmguard.serve.server.Server.serve` in the thread's event loop, so
tests can reach the governor object and set its timings. Used by
``test_governor_http.py`` and ``benchmarks/governor.py``.

The governor's signal is this process's memory cgroup, as ``slmguard serve``'s in
its unit: the benchmark puts the server and a neighbour in one child cgroup and
the neighbour must count. ``own_memory=True`` counts the server's and the engine's
own memory instead (anonymous + shmem RSS, the signal of a host without a memory
controller): a test that sets a budget from the working set runs in whatever cgroup
the test runner is in, which on a shared machine holds other processes (a CI job's
builds, CPU hogs, a VM) and moves with them.

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from slmguard.governor.leaks import LeakSettings
from slmguard.governor.policy import DegradeSettings
from slmguard.governor.runtime import Governor

MODEL_ID = "gemma-3-270m-q4_k_m"


@dataclass
class GovernedServer:
    url: str
    governor: Governor
    ctx: Any  # slmguard.serve.server.Server
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
    own_memory: bool = False,
    engine_env: dict[str, str] | None = None,
    leaks: LeakSettings | None = None,
) -> Iterator[GovernedServer]:
    """``engine_env``: added to the engine's environment (a preloaded leak); ``leaks``:
    the leak check's settings (default: the production ones)."""
    from slmguard import settings
    from slmguard.plan.overrides import EngineOverrides
    from slmguard.serve.app import create_app
    from slmguard.serve.server import build_server

    state_dir.mkdir(parents=True, exist_ok=True)
    admin_file = None
    if admin_token is not None:
        admin_file = state_dir / "admin-token"
        admin_file.write_text(admin_token + "\n")
    engine = EngineOverrides(fields={"n_ctx": n_ctx, "n_threads": 2, "n_parallel": n_parallel})
    s = settings.ServeSettings(
        engine=engine, queue_size=queue_size,
        retry_after_s=retry_after_s, state_dir=state_dir, api_key=api_key,
        admin_token_file=admin_file, memory_budget_bytes=budget_bytes,
        canary_interval_s=0.0,  # these tests count every request the engine sees
    )  # fmt: skip
    settings.validate(s)
    server = build_server(s, plan=None)
    governor = server.governor
    assert governor is not None
    if engine_env:
        server.engine.env.update(engine_env)
    if own_memory:
        governor.signal.cgroup_dir = None  # the front's and the engine's RSS, no cgroup
    # The tests' timings: a short hold, and what a degrade does (the configuration
    # build_server made is otherwise the production one: plan, model, thresholds).
    config = governor.config
    governor.config = replace(
        config,
        enabled=enabled,
        thresholds=replace(config.thresholds, recover_hold_s=recover_hold_s),
        degrade=degrade or config.degrade,
        leaks=leaks or config.leaks,
    )
    sock = _free_socket()
    port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(
        target=loop.run_until_complete, args=(server.serve(sock, create_app(server)),), daemon=True
    )
    thread.start()
    try:
        up = _until_ready(server, loop)
        if not up:
            raise RuntimeError(f"engine never became ready (state {server.engine.state})")
        yield GovernedServer(f"http://127.0.0.1:{port}", governor, server, api_key, admin_token,
                             loop)  # fmt: skip
    finally:
        loop.call_soon_threadsafe(server.stop)
        thread.join(60)
        sock.close()
        loop.close()


def _until_ready(server: Any, loop: asyncio.AbstractEventLoop) -> bool:
    """Wait for the serving loop to start the engine, then for the engine to be ready."""

    async def ready() -> bool:
        ok: bool = await server.engine.wait_ready(120)
        return ok

    return bool(asyncio.run_coroutine_threadsafe(ready(), loop).result(130))
