"""One engine, a bounded FIFO queue, and cancellation when the client goes away."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from serveproc import MODEL_ID, REQUEST_TIMEOUT_S, ServeFactory, ServerProcess, scaled

pytestmark = pytest.mark.engine

LONG = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0}


def metric(server: ServerProcess, name: str, default: float | None = None) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    if default is not None:  # a labelled counter appears with its first count
        return default
    raise AssertionError(f"no metric {name}")


def wait_for(pred: Any, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def test_full_queue_gets_429_then_fifo_proceeds(serve_factory: ServeFactory) -> None:
    s = serve_factory("--queue-size", "1")
    results: dict[str, httpx.Response] = {}

    def queued() -> None:
        body = {**LONG, "max_tokens": 1}
        results["b"] = httpx.post(s.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)

    with (
        httpx.Client(timeout=REQUEST_TIMEOUT_S) as http,
        http.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}) as running,
    ):
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # A holds the engine
        t = threading.Thread(target=queued)
        t.start()
        wait_for(lambda: (s.health() or {}).get("queue_depth") == 1, "B to be queued")
        assert metric(s, "slmguard_queue_depth") == 1
        c = http.post(s.url + "/v1/completions", json={**LONG, "max_tokens": 1})
        assert c.status_code == 429
        assert c.headers["retry-after"] == "2"
        err = c.json()["error"]
        assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
    # A's client went away: its generation is cancelled and B gets the engine.
    t.join(scaled(60))
    assert results["b"].status_code == 200
    assert results["b"].json()["usage"]["completion_tokens"] == 1


def decode_calls(server: ServerProcess) -> float:
    """llama-server's own count of llama_decode() calls (one per generated token)."""
    return metric(server, 'llamacpp:n_decode_total{engine="llama-server"}')


def assert_engine_stopped_decoding(server: ServerProcess, before: float, allowed: int) -> None:
    wait_for(lambda: not (server.health() or {}).get("busy"), "the engine slot to be free")
    # The engine, not only the front, stopped: its decode counter comes to rest (it
    # notices the closed connection at its next token or two) long before the tokens
    # the request was allowed.
    last = [decode_calls(server)]

    def at_rest() -> bool:
        time.sleep(1.0)
        now = decode_calls(server)
        still, last[0] = now == last[0], now
        return still

    wait_for(at_rest, "the engine's decode counter to stop moving")
    assert last[0] - before < allowed // 2


def test_disconnect_cancels_generation(server: ServerProcess) -> None:
    before = decode_calls(server)
    with (
        httpx.Client(timeout=REQUEST_TIMEOUT_S) as http,
        http.stream(
            "POST", server.url + "/v1/completions", json={**LONG, "max_tokens": 64, "stream": True}
        ) as resp,
    ):
        n = 0
        for line in resp.iter_lines():
            if line.startswith("data:"):
                n += 1
                if n == 3:
                    break
    assert_engine_stopped_decoding(server, before, 64)
    assert metric(server, 'slmguard_cancelled_generations_total{reason="client"}') >= 1
    ok = httpx.post(
        server.url + "/v1/completions", json={**LONG, "max_tokens": 1}, timeout=REQUEST_TIMEOUT_S
    )
    assert ok.status_code == 200


def test_disconnect_cancels_non_stream_generation(serve_factory: ServeFactory) -> None:
    """The client goes away once the engine decodes its request, not after a set time (a
    0.8 s client timeout outlived the whole answer, capped at 64 tokens, on a machine
    decoding 97 tok/s). llama-server notices a closed connection of a request without a
    stream only at its next poll (about a second), so the answer asked is long, 400
    tokens (the slot holds 512), and the engine must stop before half of them; the front
    counts the cancellation only if the generation was still running. The front's own step
    probe decodes first after a start: the count starts after it."""
    s = serve_factory()

    def probed() -> bool:
        return ((s.health() or {}).get("liveness") or {}).get("step_s") is not None

    wait_for(probed, "the front's step probe of its engine")
    before = decode_calls(s)
    cancelled = metric(s, 'slmguard_cancelled_generations_total{reason="client"}', 0.0)
    body = json.dumps({**LONG, "max_tokens": 400}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", s.port), timeout=REQUEST_TIMEOUT_S) as sock:
        sock.sendall(head.encode() + body)
        wait_for(lambda: decode_calls(s) > before, "the engine to decode the request")
    assert_engine_stopped_decoding(s, before, 400)
    after = metric(s, 'slmguard_cancelled_generations_total{reason="client"}')
    assert after == cancelled + 1
