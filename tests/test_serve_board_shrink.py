"""A board's ladder shrinks the lowest-priority model's context under real memory pressure,
end to end (issue 39), and grows it back when the pressure leaves.

Real engines and the real model: the plan ``slmguard plan`` makes for this host with the
embedded Gemma 3 270M pinned as the primary (n_ctx 512, priority 100) and the same file
pinned as ``low`` (n_ctx 8192, priority 20), served in a thread as ``serve --plan`` builds
it (boardserver.py; the governor counts the front's and the engines' own memory). The
limit is the governor's budget, set once from the service's measured working set (70 %);
the pressure is real memory: the front's process maps and writes a buffer (degrade),
then holds less of it (below the recovery line, above what the next doubling needs),
then none. Checked from the engines' processes: ``low``'s engine is replaced by one
whose command line has the smaller ``--ctx-size`` while the primary keeps its engine,
both answer 200 at the smaller context, and ``low`` runs its full context again after.
"""

from __future__ import annotations

import itertools
import logging
import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from boardserver import board_plan, board_server
from governorserver import GovernedServer
from serveproc import REQUEST_TIMEOUT_S, engine_available
from slmguard.governor.policy import Level
from waiting import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow]

if not engine_available():  # pragma: no cover - depends on the machine
    pytest.skip("the llama-server binary is not there (run `make`)", allow_module_level=True)

MIB = 1 << 20
PAGE = 4096
LOW_CTX = 8192  # halving it frees 72 MiB of KV: a step far larger than the drift
START_PCT = 70.0  # the working set against the budget before the pressure
DEGRADE_AT_PCT = 94.0  # what the buffer brings it to: degrade (92 %), below critical (97 %)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GovernedServer]:
    tmp = tmp_path_factory.mktemp("board-shrink")
    plan = board_plan(
        tmp, "embedded,ctx=512,slots=1", f"embedded,name=low,ctx={LOW_CTX},slots=1,priority=20"
    )
    with board_server(tmp / "state", plan, shrink_cooldown_s=1.0) as s:
        yield s


def complete(srv: GovernedServer, name: str | None) -> httpx.Response:
    """A 2-token completion from the model ``name`` (None: the primary)."""
    if name is None:
        name = srv.ctx.models.primary.model.names[0]
    body = {"model": name, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)


def answered(srv: GovernedServer, name: str | None) -> bool:
    return complete(srv, name).status_code == 200


def ctx_size(pid: int | None) -> int | None:
    """``--ctx-size`` on the engine process's own command line (None: no such process)."""
    if pid is None:
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for flag, value in itertools.pairwise(argv):
        if flag == b"--ctx-size":
            return int(value)
    return None


def engine_of(srv: GovernedServer, name: str) -> Any:
    return srv.ctx.models.get(name).engine


class Held:
    """Real memory in the front's process: an anonymous mapping, every page written."""

    def __init__(self) -> None:
        self.buf: mmap.mmap | None = None

    def resize(self, nbytes: int) -> None:
        """Hold ``nbytes`` (rounded down to pages; 0: nothing) instead of what it held."""
        self.close()
        if nbytes >= PAGE:
            self.buf = mmap.mmap(-1, nbytes // PAGE * PAGE)
            self.buf[0 : len(self.buf) : PAGE] = b"\1" * (len(self.buf) // PAGE)

    @property
    def nbytes(self) -> int:
        return len(self.buf) if self.buf is not None else 0

    def close(self) -> None:
        if self.buf is not None:
            self.buf.close()
            self.buf = None


def low_status(srv: GovernedServer) -> dict[str, Any]:
    status = srv.call(srv.governor.status)
    return next(m for m in status["models"] if m["model"] == "low")


def settled(srv: GovernedServer) -> int | None:
    """low's context once its engine runs what the governor decided (None: reloading)."""
    low, state = engine_of(srv, "low"), srv.governor.model("low").state
    n = ctx_size(low.pid)
    return n if n == state.n_ctx and low.state == "ready" else None


def test_pressure_shrinks_the_lowest_priority_context_then_it_grows_back(
    srv: GovernedServer, caplog: pytest.LogCaptureFixture
) -> None:
    gov = srv.governor
    low, primary = engine_of(srv, "low"), srv.ctx.models.primary.engine
    # Both warmed: on a loaded machine an engine may still be loading its model (503).
    wait_for(lambda: answered(srv, "low") and answered(srv, None), 120, "both models answering")
    primary_pid = primary.pid
    assert ctx_size(low.pid) == LOW_CTX and ctx_size(primary_pid) == 512
    caplog.set_level(logging.INFO, logger="slmguard.governor")
    used = gov.signal.sample().used_bytes
    budget = int(used * 100 / START_PCT)
    gov.signal.budget_bytes = budget
    held = Held()
    try:
        # Degrade: the lowest priority's context is shrunk (a new engine, a smaller
        # --ctx-size); the pressure stays at shed, where requests get 503.
        held.resize(int(budget * DEGRADE_AT_PCT / 100) - used)
        wait_for(lambda: (settled(srv) or LOW_CTX) < LOW_CTX, 120, "low at a smaller context")
        small = settled(srv)
        assert small is not None and 512 <= small < LOW_CTX
        assert not gov.model("low").state.parked and gov.state.level is not Level.CRITICAL
        # Less pressure: below the recovery line (80 %), yet not low enough for the next
        # doubling (its KV would cross it again): normal, served at the smaller context.
        growth = small * low_status(srv)["kv_bytes_per_token"]
        target = int(budget * 0.80) - growth // 2
        held.resize(held.nbytes + target - gov.signal.sample().used_bytes)
        wait_for(lambda: gov.state.level is Level.NORMAL, 60, "the level back to normal")
        wait_for(lambda: answered(srv, "low"), 120, "low answering at its smaller context")
        assert settled(srv) == small and answered(srv, None)
        # The primary, of higher priority, kept its engine and its context.
        assert (primary.pid, ctx_size(primary.pid)) == (primary_pid, 512)
        # No pressure: the context grows back to the full one, served again.
        held.close()
        wait_for(lambda: settled(srv) == LOW_CTX, 120, "low's full context back")
        wait_for(lambda: answered(srv, "low"), 120, "low answering at its full context")
    finally:
        held.close()
        gov.signal.budget_bytes = None
    wait_for(lambda: gov.state.level is Level.NORMAL, 60, "the level back to normal")
    assert primary.pid == primary_pid
    events = [r.getMessage() for r in caplog.records]
    shrinks = [e for e in events if "governor.context_shrink" in e]
    grows = [e for e in events if "governor.context_grow" in e]
    assert shrinks and all('"model": "low"' in e for e in shrinks), shrinks
    assert grows and all('"model": "low"' in e for e in grows), grows
