"""A 503 about an engine on its way back says when it is expected to serve (issue 40).

One real server for the module, its engine SIGKILLed for real: the Retry-After of a
request refused meanwhile (a generation, an engine view passed through) counts the
restart backoff left and the engine's last load, which ``/health`` shows; clients that
retry twice after Retry-After, as the openai and anthropic libraries do, get every
request answered across the kill. Nothing here times the server: the bounds are
checked against what ``/health`` reports, and waits go through ``scaled``.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from serveproc import MODEL_ID, REQUEST_TIMEOUT_S, ServerProcess, scaled, start_server
from slmguard.settings import ServeSettings
from waiting import wait_for

pytestmark = pytest.mark.engine

ADMIN = "retry-admin-token"
#: The restart backoff, long enough that a request sent once /health says "restarting"
#: is refused before the backoff ends even on a busy machine; max = initial: no doubling
#: over the module's kills.
BACKOFF_S = scaled(3)
DEFAULT_S = ServeSettings.retry_after_s
MAX_S = ServeSettings.retry_after_max_s
SHORT = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
RETRIES = 2  # as the openai and anthropic clients retry by default


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("retry-after")
    token = tmp / "admin-token"
    token.write_text(ADMIN + "\n")
    token.chmod(0o600)
    backoff = str(BACKOFF_S)
    s = start_server(tmp, ["--admin-token-file", str(token), "--restart-backoff-initial-s",
                           backoff, "--restart-backoff-max-s", backoff])  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


def kill_engine(s: ServerProcess) -> dict[str, Any]:
    """SIGKILL the running engine; /health as it was just before."""
    before = s.wait_state("ready")
    os.kill(before["engine"]["pid"], signal.SIGKILL)
    return before


def retry_after(resp: httpx.Response) -> int:
    assert resp.status_code in (429, 503), resp.text
    value = resp.headers.get("retry-after")
    assert value is not None and value.isdigit(), (resp.status_code, resp.headers)
    return int(value)


def test_a_503_while_the_engine_restarts_says_when_it_will_be_back(srv: ServerProcess) -> None:
    before = kill_engine(srv)
    load_s = before["engine"]["last_load_s"]  # the load the restart is expected to take
    assert isinstance(load_s, float) and load_s > 0, before["engine"]
    srv.wait_state("restarting", timeout_s=scaled(10))
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        refused = client.post(srv.url + "/v1/completions", json=SHORT)
        view = client.get(srv.url + "/slots", headers={"Authorization": f"Bearer {ADMIN}"})
    after = srv.health() or {}
    engine = after.get("engine") or {}
    assert refused.json()["error"]["code"] == "engine_restarting", refused.text
    assert view.json()["error"]["code"] == "engine_restarting", view.text
    # The backoff left can only have shrunk since each answer; the last load is still the
    # one before the kill while the engine has not served again.
    left = engine["backoff_left_s"] if after.get("state") == "restarting" else 0.0
    floor = max(DEFAULT_S, math.ceil(left + load_s))
    for resp in (refused, view):  # a generation, and an engine view passed through
        assert floor <= retry_after(resp) <= MAX_S, (resp.headers, engine)
    health = srv.wait_state("ready", timeout_s=scaled(120))
    assert health["engine"]["last_load_s"] > 0  # the restart's own load, measured
    metrics = httpx.get(srv.url + "/metrics", timeout=scaled(30)).text
    assert "slmguard_engine_last_load_seconds " in metrics


def _client(url: str, answers: list[tuple[int, str | None]], lock: threading.Lock,
            stop: threading.Event, outcomes: list[list[int]]) -> None:  # fmt: skip
    """Short completions until ``stop``, each retried at most twice after its 503's or
    429's Retry-After; each request's statuses in ``outcomes``."""
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        while not stop.is_set():
            statuses: list[int] = []
            for attempt in range(RETRIES + 1):
                resp = client.post(url + "/v1/completions", json=SHORT)
                statuses.append(resp.status_code)
                with lock:
                    answers.append((resp.status_code, resp.headers.get("retry-after")))
                if resp.status_code not in (429, 503) or attempt == RETRIES:
                    break
                threading.Event().wait(retry_after(resp))  # the wait the server asked for
            with lock:
                outcomes.append(statuses)


def _back(s: ServerProcess, restarts: int) -> bool:
    health = s.health() or {}
    return health.get("state") == "ready" and health["engine"]["restarts"] > restarts


def test_clients_that_retry_after_retry_after_see_every_request_answered_across_a_kill(
    srv: ServerProcess,
) -> None:
    answers: list[tuple[int, str | None]] = []
    outcomes: list[list[int]] = []
    lock, stop = threading.Lock(), threading.Event()
    threads = [threading.Thread(target=_client, args=(srv.url, answers, lock, stop, outcomes))
               for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(outcomes) >= 2, 120, "the clients' first answers")
        before = kill_engine(srv)
        restarts = before["engine"]["restarts"]
        # Until the engine served again and each client had requests answered after it.
        wait_for(lambda: _back(srv, restarts), 120, "the engine back after the kill")
        settled = len(outcomes)
        wait_for(lambda: len(outcomes) >= settled + 2, 120, "answers after the restart")
    finally:
        stop.set()
        for t in threads:
            t.join(scaled(300))
    refused = [a for a in answers if a[0] in (429, 503)]
    assert refused, "no request met the engine while it was down: the kill was not crossed"
    assert all(ra is not None for _, ra in refused), refused
    failed = [statuses for statuses in outcomes if statuses[-1] != 200]
    assert not failed, (failed, refused)
