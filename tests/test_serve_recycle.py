"""Leak-aware recycling with the real engine and a real leak (issue 40).

llama-server is started through ``tests/leakshim.c`` (LD_PRELOAD), which leaks written
heap for every generation request the engine reads: the engine's RssAnon grows for
real and the governor reads it as it reads any engine. The limit is set so that its
shed watermark lies ``ROOM_BYTES`` above the working set, which the leak would reach
within tens of requests; the governor must recycle the engine before that, while two
clients keep sending (one streaming, each waiting for the leak check to have read the
engine after its answer: a slow leak, whatever this machine's speed, as on a board)
and a session goes on across the recycle: no
request fails, the session's turns are all there, the level never leaves normal, and
the recycle is an event with its evidence in /api/v1/governor, /health and /metrics.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from governorserver import MODEL_ID, GovernedServer, governed_server
from leakshim import build, engine_env
from slmguard.governor.leaks import LeakSettings
from waiting import scaled, wait_for

pytestmark = pytest.mark.engine

MiB = 1 << 20
LEAK_BYTES = 8 * MiB  # per chat request the engine reads
ROOM_BYTES = 320 * MiB  # from the working set at start to the shed watermark


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = build(tmp_path_factory.mktemp("leakshim"))
    if built is None:
        pytest.skip("no C compiler (cc) to build the preloaded leak")
    return built


def _chat(srv: GovernedServer, client: httpx.Client, *, stream: bool, **extra: Any) -> str:
    """One chat turn; returns "ok" or what went wrong (status and body)."""
    body = {"model": MODEL_ID, "max_tokens": 4, "stream": stream, **extra}
    body.setdefault("messages", [{"role": "user", "content": "Say one word."}])
    url = srv.url + "/v1/chat/completions"
    if not stream:
        resp = client.post(url, json=body, headers=srv.api_headers())
        return "ok" if resp.status_code == 200 else f"{resp.status_code} {resp.text[:200]}"
    with client.stream("POST", url, json=body, headers=srv.api_headers()) as resp:
        text = resp.read().decode()
    if resp.status_code != 200 or '"error"' in text or "data: [DONE]" not in text:
        return f"{resp.status_code} {text[-200:]}"
    return "ok"


def _until_read_again(srv: GovernedServer) -> None:
    """Wait until the leak check has read the engine again, or a recycle is under way
    (the engine is not read while it restarts)."""
    recycling = srv.governor.recycling
    seen = recycling.engine_track.last
    wait_for(lambda: recycling.engine_track.last is not seen or recycling.pending, 60,
             "the leak check reading the engine")  # fmt: skip


class Clients:
    """Two clients sending chat requests (one streaming) until stopped, each waiting after
    an answer for the leak check to read the engine: the leak check samples at most every
    0.25 s, and on a fast machine two clients sending back to back put 4-5 requests (32-40
    MiB of leak) between two readings, which delayed the verdict past the shed watermark.
    """

    def __init__(self, srv: GovernedServer) -> None:
        self.srv = srv
        self.outcomes: list[str] = []
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._loop, args=(stream,), daemon=True)
            for stream in (False, True)
        ]

    def _loop(self, stream: bool) -> None:
        with httpx.Client(timeout=scaled(300)) as client:
            while not self.stop.is_set():
                try:
                    self.outcomes.append(_chat(self.srv, client, stream=stream))
                except httpx.HTTPError as err:
                    self.outcomes.append(f"transport: {err!r}")
                try:
                    _until_read_again(self.srv)
                except AssertionError as err:
                    self.outcomes.append(str(err))
                    return

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(scaled(300))


def _limit_with_room(srv: GovernedServer, working_set: int) -> int:
    """The budget whose shed watermark lies ``ROOM_BYTES`` above ``working_set``.

    The working set counts this test process (the front runs in it) and the engine. A
    limit of the working set plus a fixed amount put the watermark 0.85 x that amount
    less 0.15 x the working set above it: the room shrank as earlier test files grew the
    pytest process (litellm's imports), and in a whole-suite run the warmup requests'
    leak alone crossed it, so the server shed before the leak check had its baseline.
    """
    shed = srv.governor.config.thresholds.shed_pct / 100
    return math.ceil((working_set + ROOM_BYTES) / shed)


def _recycled_or_left_normal(srv: GovernedServer) -> bool:
    """The engine was recycled, or the level moved first (the test has failed then)."""
    return srv.governor.recycling.count >= 1 or bool(srv.governor.transitions)


def _status(srv: GovernedServer) -> dict[str, Any]:
    resp = httpx.get(srv.url + "/api/v1/governor", headers=srv.admin_headers(), timeout=30)
    assert resp.status_code == 200
    data: dict[str, Any] = resp.json()
    return data


def test_a_leaking_engine_is_recycled_before_shed_and_no_request_fails(
    tmp_path: Path, shim: Path
) -> None:
    leaks = LeakSettings(warmup_requests=4, drain_timeout_s=scaled(120))
    with governed_server(
        tmp_path / "state", n_ctx=1024, own_memory=True, queue_size=8, leaks=leaks,
        engine_env=engine_env(shim, LEAK_BYTES),
    ) as srv:  # fmt: skip
        working_set = _status(srv)["signal"]["working_set_bytes"]
        budget = _limit_with_room(srv, working_set)
        srv.call(lambda: setattr(srv.governor.signal, "budget_bytes", budget))
        pid_before = srv.ctx.engine.pid
        session: list[str] = []
        with httpx.Client(timeout=scaled(300)) as client:

            def turn(i: int) -> None:
                said = [{"role": "user", "content": f"Turn {i}."}]
                session.append(_chat(srv, client, stream=False, session_id="kitchen-1",
                                     messages=said))  # fmt: skip

            turn(1)
            turn(2)
            with Clients(srv) as clients:
                wait_for(lambda: _recycled_or_left_normal(srv), 120,
                         "the leaking engine recycled", interval_s=1.0)  # fmt: skip
                assert srv.governor.recycling.count >= 1, list(srv.governor.transitions)
                served = len(clients.outcomes)
                wait_for(lambda: len(clients.outcomes) >= served + 4, 60,
                         "four more answers from the fresh engine", interval_s=1.0)  # fmt: skip
            turn(3)
            turn(4)
        status = _status(srv)
        health = httpx.get(srv.url + "/health", timeout=30).json()
        metrics = httpx.get(srv.url + "/metrics", headers=srv.api_headers(), timeout=30).text
        stored = srv.ctx.sessions.store.messages("kitchen-1")

    failed = [o for o in clients.outcomes + session if o != "ok"]
    assert not failed, failed
    record = status["leaks"]["recycles"][0]
    assert record["pid_before"] == pid_before and record["pid_after"] != pid_before
    # Recycled for the drift it measured (and, for a drain, what the generations queued
    # then would add on the old engine), before the shed watermark: the level never moved.
    ahead = record["drain_growth_bytes"] if record["verdict"] == "drain" else 0
    assert record["drift_bytes"] + ahead >= leaks.idle_fraction * record["bound_bytes"]
    assert record["per_1000_requests_bytes"] >= 1000 * LEAK_BYTES // 2
    assert status["transitions"] == [] and status["level"] == "normal"
    assert status["counters"]["rejections"] == {}
    # The fresh engine holds less than the leaking one did.
    assert status["leaks"]["engine"] is None or (
        status["leaks"]["engine"]["first_bytes"] < record["current_bytes"]
    )
    # Sessions intact: every turn before, across and after the recycle is stored.
    assert [m.role for m in stored] == ["user", "assistant"] * 4
    assert [m.content for m in stored if m.role == "user"] == [f"Turn {i}." for i in range(1, 5)]
    # The evidence everywhere the operator looks: /health, metrics; not an engine restart.
    assert health["extra"]["governor"]["recycle"]["count"] >= 1
    assert health["extra"]["governor"]["recycle"]["last"]["pid_before"] == pid_before
    assert health["engine"]["restarts"] == 0
    assert "slmguard_governor_recycles_total 1.0" in metrics or (
        "slmguard_governor_recycles_total 2.0" in metrics
    )
