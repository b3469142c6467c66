"""A board's memory (issue 39): on-demand loads make room by evicting the idle model, never
the busy one, and the governor's ladder acts on the lowest priority first.

Real engines and models: the plan ``slmguard plan`` makes for this host with the embedded
Gemma 3 270M pinned (priority 100), a second Gemma on demand with a larger context
(``big``, priority 20) and the tests' tiny embedder on demand (``embed``, priority 30),
served in a thread as ``serve --plan`` builds it
(boardserver.py). Memory is made short for real through the governor's own budget
(the smallest limit wins), set from the service's measured working set: its own
processes' memory, the front's and each engine's, not the test runner's cgroup. A
neighbour process beside the service holds 64 MiB throughout: it is never killed nor
made to give any of it back.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from boardserver import board_plan, board_server
from governorserver import GovernedServer
from serveproc import REQUEST_TIMEOUT_S, engine_available
from slmguard.governor.policy import Level
from slmguard.host.process import read_status
from slmguard.host.procfs import ROOT
from waiting import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow]

if not engine_available():  # pragma: no cover - depends on the machine
    pytest.skip("the llama-server binary is not there (run `make`)", allow_module_level=True)

MIB = 1 << 20
NEIGHBOUR_MIB = 64
NEIGHBOUR = (
    "import sys\n"
    f"held = bytearray({NEIGHBOUR_MIB} << 20)\n"
    "for i in range(0, len(held), 4096): held[i] = 1\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.fixture(scope="module")
def neighbour() -> Iterator[subprocess.Popen[str]]:
    pipe = subprocess.PIPE
    with subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdin=pipe, stdout=pipe,
                          text=True) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
        proc.kill()


@pytest.fixture(scope="module")
def srv(
    tmp_path_factory: pytest.TempPathFactory, neighbour: subprocess.Popen[str]
) -> Iterator[GovernedServer]:
    tmp = tmp_path_factory.mktemp("board-memory")
    plan = board_plan(
        tmp, "embedded,ctx=512,slots=1",
        "embedded,on-demand,name=big,ctx=4096,slots=1,priority=20",
        "{embed},on-demand,name=embed,priority=30,idle-unload=1h",
    )  # fmt: skip
    with board_server(tmp / "state", plan, shrink_cooldown_s=1.0, restart_max=1) as s:
        yield s


def model(srv: GovernedServer, name: str) -> Any:
    return srv.ctx.models.get(name)


def post(srv: GovernedServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=REQUEST_TIMEOUT_S)


def unload_embed(srv: GovernedServer) -> None:
    """Unload embed as its idle time would (test_serve_board.py waits for that)."""
    srv.call(lambda: srv.ctx.residency.evict("embed", "unloaded by the test"))
    assert model(srv, "embed").unloaded


def load_big(srv: GovernedServer) -> int:
    resp = post(srv, "/v1/completions", {"model": "big", "prompt": "Hi", "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    pid = model(srv, "big").engine.pid
    assert isinstance(pid, int)
    return pid


def embed(srv: GovernedServer) -> httpx.Response:
    return post(srv, "/v1/embeddings", {"model": "embed", "input": "paris is in france"})


def short_of_memory_for_embed(srv: GovernedServer) -> None:
    """A budget whose shed line the service crosses by loading embed beside big, and stays
    below with big evicted instead: the middle of (used - big + embed, used + embed], and
    above what is used now (the level stays normal)."""
    gov = srv.governor
    srv.call(gov.tick)
    used = gov.signal.sample().used_bytes
    held = gov.model("big").held_bytes()
    need = gov.model("embed").need_bytes()
    low, high = max(used - held + need, used), used + need
    assert high - low > 16 * MIB, (used, held, need)  # room to be robust against drift
    shed = gov.config.thresholds.shed_pct
    gov.signal.budget_bytes = int((low + high) / 2 / (shed / 100))


def no_budget(srv: GovernedServer) -> None:
    srv.governor.signal.budget_bytes = None
    wait_for(lambda: srv.governor.state.level is Level.NORMAL, 60, "the level back to normal")


def test_loading_an_on_demand_model_evicts_the_idle_one(srv: GovernedServer) -> None:
    unload_embed(srv)
    big_pid = load_big(srv)
    evictions = srv.ctx.residency.evictions
    short_of_memory_for_embed(srv)
    try:
        resp = embed(srv)
        assert resp.status_code == 200, resp.text
        assert model(srv, "big").state == "unloaded"
        assert srv.ctx.residency.evictions == evictions + 1
        with pytest.raises(ProcessLookupError):
            os.kill(big_pid, 0)
        assert model(srv, "embed").state in ("ready", "degraded")
    finally:
        no_budget(srv)


def test_a_busy_model_is_never_evicted_the_load_is_refused_naming_the_memory(
    srv: GovernedServer,
) -> None:
    unload_embed(srv)
    big_pid = load_big(srv)
    short_of_memory_for_embed(srv)
    streaming = _Stream(srv, "big")
    try:
        streaming.started.wait(REQUEST_TIMEOUT_S)
        assert streaming.error is None and model(srv, "big").busy()
        resp = embed(srv)
        assert resp.status_code == 503, resp.text
        error = resp.json()["error"]
        assert error["code"] == "model_does_not_fit" and resp.headers["Retry-After"] == "1"
        assert "embed cannot be loaded now" in error["message"] and "MiB" in error["message"]
        assert model(srv, "big").engine.pid == big_pid and model(srv, "embed").unloaded
    finally:
        streaming.stop()
    wait_for(lambda: not model(srv, "big").busy(), 60, "the stream to end")
    try:
        assert embed(srv).status_code == 200  # idle now: evicted for it
        assert model(srv, "big").state == "unloaded"
    finally:
        no_budget(srv)


def test_the_ladder_evicts_the_lowest_priority_first_then_the_next(
    srv: GovernedServer, caplog: pytest.LogCaptureFixture
) -> None:
    load_big(srv)
    assert embed(srv).status_code == 200
    primary = srv.ctx.models.primary
    primary_pid, primary_ctx = primary.engine.pid, primary.engine.config.n_ctx
    gov = srv.governor
    caplog.set_level(logging.INFO, logger="slmguard.governor")
    try:
        _pressure(srv, 94.0)
        wait_for(lambda: model(srv, "big").unloaded, 60, "big evicted by the governor")
        assert not model(srv, "embed").unloaded  # the next one waits its turn
        # Back to normal once the signal no longer counts big's exiting process (a
        # budget set from a sample still holding it would not be short at all).
        wait_for(lambda: gov.state.level is Level.NORMAL, 60, "the level back to normal")
        _pressure(srv, 94.0)  # short again: the next one
        wait_for(lambda: model(srv, "embed").unloaded, 60, "embed evicted by the governor")
    finally:
        no_budget(srv)
    evicted = [r.getMessage() for r in caplog.records if "governor.evict" in r.getMessage()]
    assert '"model": "big"' in evicted[0] and '"model": "embed"' in evicted[-1], evicted
    assert gov.counters.snapshot()["degradations"]["evict"] >= 2
    # The primary was left as it was: same engine, same context.
    assert (primary.engine.pid, primary.engine.config.n_ctx) == (primary_pid, primary_ctx)


def _pressure(srv: GovernedServer, pct: float) -> None:
    """A budget that puts the service's working set at ``pct`` % of it."""
    used = srv.governor.signal.sample().used_bytes
    srv.governor.signal.budget_bytes = int(used * 100 / pct)


def test_an_on_demand_engine_that_gives_up_is_loaded_again_by_its_next_request(
    srv: GovernedServer,
) -> None:
    """Killed twice (the budget is one restart here): a pinned model would end the
    server (70); an on-demand one waits, failed, for its next request."""
    assert embed(srv).status_code == 200
    engine = model(srv, "embed").engine
    for _ in range(2):
        pid = wait_for(lambda: engine.pid, 60, "embed's engine running")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda p=pid: engine.pid != p, 60, "the killed engine gone")
    wait_for(lambda: engine.state == "failed", 60, "embed's engine to give up")
    assert srv.ctx.engine.state == "ready" and srv.ctx._uvicorn.should_exit is False
    assert srv.ctx._watchdog_ok()  # systemd's watchdog still fed
    resp = embed(srv)
    assert resp.status_code == 200, resp.text
    assert model(srv, "embed").state in ("ready", "degraded") and engine.pid is not None


def test_the_neighbour_was_never_touched(
    srv: GovernedServer, neighbour: subprocess.Popen[str]
) -> None:
    assert neighbour.poll() is None  # alive
    status = read_status(ROOT, neighbour.pid)
    assert status is not None and status.rss_anon_bytes is not None
    assert status.rss_anon_bytes >= NEIGHBOUR_MIB * MIB  # none of it given back


class _Stream:
    """A long streamed completion on ``name`` in a thread: the model is busy until stop()."""

    def __init__(self, srv: GovernedServer, name: str) -> None:
        self.started = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        body = {"model": name, "prompt": "Once upon a time", "max_tokens": 3000,
                "stream": True, "temperature": 0}  # fmt: skip
        self._thread = threading.Thread(target=self._run, args=(srv.url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body,
                              timeout=REQUEST_TIMEOUT_S) as resp:  # fmt: skip
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.started.set()
                    if self._stop.is_set():
                        return
        except BaseException as err:  # reported to the test
            self.error = err
        finally:
            self.started.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(REQUEST_TIMEOUT_S)
