"""Governor on a real server (real engine, real model): trim API, status, shed, degrade, recover.

The server runs in a thread of this process (``governorserver.py``), built by
``slmguard.serve.server.build_server`` as ``slmguard serve`` builds it. Memory
pressure is produced for real by lowering the configured budget below the
service's measured working set (the smallest limit wins), so the governor
reacts to its real signal. That signal is the server's own memory (this
process's and the engine's anonymous + shmem RSS), not the test runner's memory
cgroup: on a shared machine other processes there moved it during a resize (75
MiB beside CPU hogs and a VM) and parked the engine. The real-cgroup scenario
with a neighbour process is ``test_governor_scenario.py`` and
``benchmarks/governor.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from governorserver import MODEL_ID, GovernedServer, governed_server
from slmguard.governor.policy import Level

pytestmark = [pytest.mark.engine, pytest.mark.slow]

from serveproc import REQUEST_TIMEOUT_S, engine_available, scaled  # noqa: E402

if not engine_available():  # pragma: no cover - depends on the machine
    pytest.skip("the llama-server binary is not there (run `make`)", allow_module_level=True)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GovernedServer]:
    with governed_server(tmp_path_factory.mktemp("gov"), n_ctx=1024, own_memory=True) as s:
        yield s


def chat(
    srv: GovernedServer, messages: list[dict[str, str]], max_tokens: int = 2
) -> httpx.Response:
    return httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens,
              "temperature": 0},
        headers=srv.api_headers(),
        timeout=REQUEST_TIMEOUT_S,
    )  # fmt: skip


def wait_for(predicate: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    pytest.fail("condition not reached in time")


ADMIN = "test-admin-token"
KEY = "test-api-key"


@pytest.mark.parametrize(
    ("token", "body", "status", "param"),
    [
        (None, {"keep_recent": 512}, 401, "invalid_admin_token"),
        (KEY, {"keep_recent": 512}, 401, "invalid_admin_token"),  # the API key is not enough
        ("wrong", {"keep_recent": 512}, 401, "invalid_admin_token"),
        (ADMIN, {}, 400, "keep_recent"),
        (ADMIN, {"keep_recent": -1}, 400, "keep_recent"),
        (ADMIN, {"keep_recent": "512"}, 400, "keep_recent"),
        (ADMIN, {"keep_recent": 1.5}, 400, "keep_recent"),
        (ADMIN, {"keep_recent": True}, 400, "keep_recent"),
        (ADMIN, {"keep_recent": 2**21}, 400, "keep_recent"),
        (ADMIN, {"keep_recent": 5, "session_id": "a b"}, 400, "session_id"),
        (ADMIN, {"keep_recent": 5, "session_id": 7}, 400, "session_id"),
        (ADMIN, {"keep_recent": 5, "extra": 1}, 400, "extra"),
        (ADMIN, [512], 400, None),
        (ADMIN, {"keep_recent": 5, "session_id": "nobody"}, 404, "session_not_found"),
    ],
)
def test_trim_auth_and_validation(
    srv: GovernedServer, token: str | None, body: Any, status: int, param: str | None
) -> None:
    """``param``: the field a 400 names, or the error code of other statuses."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    resp = httpx.post(srv.url + "/api/v1/context/trim", json=body, headers=headers, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if status == 400:
        # Validation of the JSON body (not of a missing query parameter): the
        # envelope names the offending field; a field the endpoint does not know is
        # unsupported rather than invalid.
        assert err["code"] == {
            "extra": "unsupported_parameter",
            "session_id": "invalid_session_id",
        }.get(param, "invalid_value")
        assert err["param"] == param if param else "query" not in err["message"]
    elif param is not None:
        assert err["code"] == param


def test_trim_malformed_json(srv: GovernedServer) -> None:
    resp = httpx.post(
        srv.url + "/api/v1/context/trim",
        content=b'{"keep_recent": ',
        headers={**srv.admin_headers(), "Content-Type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("token", "status"), [(None, 401), ("wrong", 401), (KEY, 200), (ADMIN, 200)]
)
def test_governor_status_auth(srv: GovernedServer, token: str | None, status: int) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    resp = httpx.get(srv.url + "/api/v1/governor", headers=headers, timeout=30)
    assert resp.status_code == status


def test_governor_status_content(srv: GovernedServer) -> None:
    wait_for(lambda: srv.governor.snapshot is not None)
    data = httpx.get(srv.url + "/api/v1/governor", headers=srv.admin_headers(), timeout=30).json()
    assert data["level"] == "normal"
    assert data["n_ctx"] == data["n_ctx_full"] == 1024
    assert data["thresholds"]["shed_pct"] == 85.0
    signal = data["signal"]
    assert signal["source"] in ("cgroup1", "cgroup2", "processes")
    assert signal["working_set_bytes"] > 100 << 20  # the engine holds the model and KV cache
    assert signal["limit_bytes"] >= signal["working_set_bytes"]
    assert data["kv_bytes_per_token"] == 18_432  # from the GGUF header
    health = httpx.get(srv.url + "/health", timeout=30).json()
    assert health["extra"]["governor"]["level"] == "normal"
    metrics = httpx.get(srv.url + "/metrics", headers=srv.api_headers(), timeout=30).text
    assert 'slmguard_governor_level{level="normal"} 1.0' in metrics
    assert "slmguard_governor_working_set_bytes" in metrics


def test_trim_shortens_history_and_the_next_prompt(srv: GovernedServer) -> None:
    store = srv.governor.sessions
    assert store is not None
    turns = [{"role": "system", "content": "Answer in one word."}]
    for i in range(3):
        turns.append({"role": "user", "content": f"Tell me fact number {i} about the sea. " * 2})
        turns.append({"role": "assistant", "content": f"Fact {i}: the sea is salty and wide. " * 2})
    new = [{"role": "user", "content": "And the sky?"}]
    # Token counts as the server records them: from the engine's usage figures.
    counts = []
    for msg in turns:
        tokens = chat(srv, [msg], max_tokens=1).json()["usage"]["prompt_tokens"]
        store.append("sea", [msg], tokens=[tokens])
        counts.append(tokens)
    long_prompt = srv.call(lambda: srv.ctx.sessions.session_prompt("sea", new))
    assert len(long_prompt) == len(turns) + 1
    long_resp = chat(srv, long_prompt, max_tokens=1)
    assert long_resp.status_code == 200
    long_tokens = long_resp.json()["usage"]["prompt_tokens"]

    keep = counts[-1] + counts[-2]  # the last user/assistant pair (a history starts at a user)
    resp = httpx.post(
        srv.url + "/api/v1/context/trim",
        json={"keep_recent": keep, "session_id": "sea"},
        headers=srv.admin_headers(),
        timeout=REQUEST_TIMEOUT_S,
    )
    assert resp.status_code == 200, resp.text
    freed = resp.json()
    assert freed["sessions_trimmed"] == 1 and freed["messages_removed"] > 0
    assert freed["tokens_removed"] > 0
    assert freed["prefix_cache_dropped"] is True
    history = store.history("sea")
    assert history[0] == turns[0]  # the system message stays
    assert 1 < len(history) < len(turns)
    assert history[1]["role"] == "user"
    assert history[1:] == turns[len(turns) - len(history) + 1 :]  # the most recent turns
    assert sum(m.tokens or 0 for m in store.messages("sea")[1:]) <= keep

    short_resp = chat(srv, srv.call(lambda: srv.ctx.sessions.session_prompt("sea", new)), 1)
    assert short_resp.status_code == 200
    short_tokens = short_resp.json()["usage"]["prompt_tokens"]
    assert short_tokens < long_tokens
    assert long_tokens - short_tokens >= freed["tokens_removed"] * 0.8

    again = httpx.post(
        srv.url + "/api/v1/context/trim", json={"keep_recent": keep},
        headers=srv.admin_headers(), timeout=REQUEST_TIMEOUT_S,
    ).json()  # fmt: skip
    assert again["messages_removed"] == 0 and again["sessions_seen"] >= 1


def _budget_for(srv: GovernedServer, pct: float) -> int:
    """A budget that puts the server's own working set at ``pct`` of it."""
    snap = srv.governor.signal.sample()
    assert snap.source == "processes"  # the server's memory, not the runner's cgroup
    return int(snap.working_set_bytes * 100 / pct)


NEIGHBOUR = (
    "import sys\n"
    "b = bytearray(64 << 20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_a_neighbours_memory_does_not_move_the_signal(srv: GovernedServer) -> None:
    """Another process of this machine (here a child of the test process, in its
    cgroup) touching 64 MiB leaves the server's working set where it was."""
    before = srv.governor.signal.sample().working_set_bytes
    pipe = subprocess.PIPE
    with subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdin=pipe, stdout=pipe,
                          text=True) as neighbour:  # fmt: skip
        try:
            assert neighbour.stdout is not None
            assert neighbour.stdout.readline().strip() == "ready"
            during = srv.governor.signal.sample().working_set_bytes
        finally:
            neighbour.kill()
    assert abs(during - before) < 16 << 20, (before, during)


def test_shed_then_recover_on_the_real_signal(srv: GovernedServer) -> None:
    assert chat(srv, [{"role": "user", "content": "hi"}]).status_code == 200
    srv.governor.signal.budget_bytes = _budget_for(srv, 88.0)
    try:
        wait_for(lambda: srv.governor.state.level >= Level.SHED)
        resp = chat(srv, [{"role": "user", "content": "hi"}])
        assert resp.status_code == 503
        assert resp.headers["Retry-After"] == "1"
        assert resp.json()["error"]["code"] == "memory_shedding"
    finally:
        srv.governor.signal.budget_bytes = None
    wait_for(lambda: srv.governor.state.level is Level.NORMAL)
    assert chat(srv, [{"role": "user", "content": "hi"}]).status_code == 200
    counters = srv.governor.counters.snapshot()
    assert counters["rejections"]["memory_shedding"] >= 1
    assert counters["transitions"]["normal->shed"] >= 1


def test_degrade_shrinks_the_context_and_grows_it_back(srv: GovernedServer) -> None:
    srv.governor.signal.budget_bytes = _budget_for(srv, 93.0)
    try:
        wait_for(lambda: srv.governor.state.n_ctx == 512)
        wait_for(lambda: srv.ctx.engine.n_ctx == 512 and srv.ctx.engine.state == "ready")
        # The governor records the resize just after the engine reports ready
        # (it measures the engine's memory first): wait for this shrink's record, not
        # an earlier test's grow.
        wait_for(lambda: getattr(srv.governor.last_resize, "n_ctx_to", None) == 512)
        record = srv.governor.last_resize
        assert record is not None and record.ok
        assert (record.n_ctx_from, record.n_ctx_to) == (1024, 512)
        assert record.predicted_delta_bytes == 512 * 18_432
        # The engine really gave memory back (most of the predicted KV bytes).
        assert record.measured_delta_bytes is not None
        assert record.measured_delta_bytes > 0.5 * record.predicted_delta_bytes
        assert srv.governor.max_tokens_cap() is not None
    finally:
        srv.governor.signal.budget_bytes = None
    wait_for(lambda: srv.ctx.engine.n_ctx == 1024 and srv.ctx.engine.state == "ready")
    assert srv.governor.state.level is Level.NORMAL
    assert srv.governor.max_tokens_cap() is None
    assert chat(srv, [{"role": "user", "content": "hi"}]).status_code == 200
    degradations = srv.governor.counters.snapshot()["degradations"]
    assert degradations["context_shrink"] >= 1 and degradations["context_grow"] >= 1


def test_admin_routes_disabled_without_admin_token(tmp_path: Path) -> None:
    with governed_server(tmp_path, n_ctx=256, api_key=None, admin_token=None) as s:
        resp = httpx.post(s.url + "/api/v1/context/trim", json={"keep_recent": 5}, timeout=30)
        assert resp.status_code == 403
        assert resp.json()["error"]["code"] == "admin_disabled"
        # No token of any kind configured (loopback dev server): status is readable.
        assert httpx.get(s.url + "/api/v1/governor", timeout=30).status_code == 200


def test_wired_into_slmguard_serve(serve_factory: Any, tmp_path: Path) -> None:
    """The real ``slmguard serve`` command installs the governor (routes, health, metrics)."""
    admin_file = tmp_path / "admin-token"
    admin_file.write_text("serve-admin-secret\n")
    s = serve_factory("--admin-token-file", str(admin_file), api_key="serve-api-key")
    admin = {"Authorization": "Bearer serve-admin-secret"}
    status = httpx.get(s.url + "/api/v1/governor", headers=admin, timeout=30)
    assert status.status_code == 200
    assert status.json()["level"] == "normal" and status.json()["n_ctx_full"] == 512
    assert httpx.get(s.url + "/api/v1/governor", timeout=30).status_code == 401
    api_only = {"Authorization": "Bearer serve-api-key"}
    trim = httpx.post(
        s.url + "/api/v1/context/trim", json={"keep_recent": 512}, headers=api_only, timeout=30
    )
    assert trim.status_code == 401
    trim = httpx.post(
        s.url + "/api/v1/context/trim", json={"keep_recent": 512}, headers=admin, timeout=30
    )
    assert trim.status_code == 200, trim.text
    assert trim.json()["prefix_cache_dropped"] is True
    assert (s.state_dir / "sessions.sqlite3").exists()
    health = httpx.get(s.url + "/health", timeout=30).json()
    assert health["extra"]["governor"]["level"] == "normal"
    metrics = httpx.get(s.url + "/metrics", headers=api_only, timeout=30).text
    assert 'slmguard_governor_level{level="normal"} 1.0' in metrics


def test_prompt_that_only_misses_the_shrunk_context_gets_503(tmp_path: Path) -> None:
    # The governor acts on nothing (enabled=False); the test shrinks the context the
    # way a degrade does, so the front's handling of the engine's refusal is what runs.
    with governed_server(tmp_path, n_ctx=512, enabled=False) as s:
        s.call(lambda: s.governor.engine.resize_context(256))

        def shrunk() -> None:
            s.governor.state = replace(s.governor.state, n_ctx=256)

        s.call(shrunk)
        resp = chat(s, [{"role": "user", "content": "hello " * 300}], max_tokens=1)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "context_degraded"
        assert int(resp.headers["Retry-After"]) >= 1
        resp = chat(s, [{"role": "user", "content": "hello " * 600}], max_tokens=1)
        assert resp.status_code == 400  # too long for the full context as well
        assert resp.json()["error"]["code"] == "context_length_exceeded"
        assert s.governor.counters.snapshot()["rejections"]["context_degraded"] == 1


def test_parking_answers_clients_with_503_and_resume_serves_again(srv: GovernedServer) -> None:
    """What clients see when the engine is parked: a running request ends with 503
    ``aborted`` naming the reason, new ones get 503 ``engine_parked``, /health says
    parked; after resume the same server answers again."""
    import threading

    sup = srv.ctx.engine
    control = srv.governor.engine
    assert control is not None
    long_answer: list[httpx.Response] = []
    runner = threading.Thread(
        target=lambda: long_answer.append(
            chat(srv, [{"role": "user", "content": "Count to a thousand."}], max_tokens=600)
        )
    )
    runner.start()
    wait_for(lambda: srv.ctx.queue.busy)
    srv.call(lambda: control.park("memory test: parked"))
    runner.join(scaled(60))
    (resp,) = long_answer
    assert resp.status_code == 503 and "Retry-After" in resp.headers
    assert resp.json()["error"]["code"] == "aborted"
    assert "memory test: parked" in resp.json()["error"]["message"]
    wait_for(lambda: sup.state == "parked")
    again = chat(srv, [{"role": "user", "content": "Hi"}])
    assert again.status_code == 503 and "Retry-After" in again.headers
    assert again.json()["error"]["code"] == "engine_parked"
    health = httpx.get(srv.url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["state"] == "parked"
    srv.call(lambda: control.resume(sup.config.n_ctx))
    wait_for(lambda: sup.state == "ready", 120)
    assert chat(srv, [{"role": "user", "content": "Hi"}]).status_code == 200
    # A streamed answer cut by parking ends with an SSE error event saying why.
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 600, "temperature": 0, "stream": True}  # fmt: skip
    events: list[str] = []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body,
                      headers=srv.api_headers(), timeout=REQUEST_TIMEOUT_S) as stream:  # fmt: skip
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    srv.call(lambda: control.park("memory test: parked again"))
    assert '"code": "aborted"' in events[-1] and "parked again" in events[-1], events[-3:]
    srv.call(lambda: control.resume(sup.config.n_ctx))
    wait_for(lambda: sup.state == "ready", 120)
    assert sup.restarts == 0
