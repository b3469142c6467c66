"""Bad requests get an OpenAI-style 4xx and the server keeps serving (real server)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from serveproc import MODEL_ID, REQUEST_TIMEOUT_S, ServerProcess

pytestmark = pytest.mark.engine

GOOD: dict[str, Any] = {
    "model": MODEL_ID,
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 1,
}


def with_(**changes: Any) -> bytes:
    body = dict(GOOD)
    for key, value in changes.items():
        if value is ...:
            body.pop(key)
        else:
            body[key] = value
    return json.dumps(body).encode()


ANY = "*"  # any param (pydantic names union members in its locations)

CASES = [
    # id, path, raw body, status, error code, param
    ("malformed-json", "/v1/chat/completions", b'{"model": "x", "messages": [', 400,
     "invalid_json", None),
    ("not-an-object", "/v1/chat/completions", b"[1, 2]", 400, "invalid_value", None),
    ("messages-wrong-type", "/v1/chat/completions", with_(messages="Hi"), 400, "invalid_value",
     "messages"),
    ("max-tokens-string", "/v1/chat/completions", with_(max_tokens="5"), 400, "invalid_value",
     "max_tokens"),
    ("stream-not-bool", "/v1/chat/completions", with_(stream="yes"), 400, "invalid_value",
     "stream"),
    ("messages-missing", "/v1/chat/completions", with_(messages=...), 400, "invalid_value",
     "messages"),
    ("messages-empty", "/v1/chat/completions", with_(messages=[]), 400, "invalid_value",
     "messages"),
    ("unknown-role", "/v1/chat/completions",
     with_(messages=[{"role": "wizard", "content": "Hi"}]), 400, "invalid_value",
     "messages.0.role"),
    ("unknown-model", "/v1/chat/completions", with_(model="gpt-9"), 404, "model_not_found",
     "model"),
    ("max-tokens-zero", "/v1/chat/completions", with_(max_tokens=0), 400, "invalid_value",
     "max_tokens"),
    ("max-tokens-negative", "/v1/completions",
     json.dumps({"model": MODEL_ID, "prompt": "x", "max_tokens": -3}).encode(), 400,
     "invalid_value", "max_tokens"),
    ("temperature-too-high", "/v1/chat/completions", with_(temperature=2.5), 400,
     "invalid_value", "temperature"),
    ("temperature-negative", "/v1/chat/completions", with_(temperature=-0.1), 400,
     "invalid_value", "temperature"),
    ("n-greater-than-one", "/v1/chat/completions", with_(n=2), 400, "invalid_value", "n"),
    ("invalid-utf8", "/v1/chat/completions",
     with_(messages=[{"role": "user", "content": "@@"}]).replace(b"@@", b"\xff\xfe"),
     400, "invalid_json", None),
    ("prompt-missing", "/v1/completions", json.dumps({"model": MODEL_ID}).encode(), 400,
     "invalid_value", "prompt"),
    # Fields llama-server does not implement, or that would bypass the front's limits:
    # refused by name, never accepted and ignored.
    ("unknown-field", "/v1/chat/completions", with_(frobnicate=1), 400,
     "unsupported_parameter", "frobnicate"),
    ("n-predict-bypasses-the-cap", "/v1/chat/completions", with_(n_predict=10_000), 400,
     "unsupported_parameter", "n_predict"),
    ("id-slot", "/v1/completions",
     json.dumps({"model": MODEL_ID, "prompt": "x", "id_slot": 0}).encode(), 400,
     "unsupported_parameter", "id_slot"),
    # store: true asks the server to keep the completion (false only labels it: accepted)
    ("store", "/v1/chat/completions", with_(store=True), 400, "invalid_value", "store"),
    ("functions-legacy", "/v1/chat/completions", with_(functions=[]), 400,
     "unsupported_parameter", "functions"),
    ("unknown-message-field", "/v1/chat/completions",
     with_(messages=[{"role": "user", "content": "Hi", "audio": {}}]), 400,
     "unsupported_parameter", "messages.0.audio"),
    ("image-part", "/v1/chat/completions",
     with_(messages=[{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]), 400,
     "images_not_supported", "messages.0.content.0.image_url.url"),
    ("named-tool-choice-not-in-tools", "/v1/chat/completions",
     with_(tool_choice={"type": "function", "function": {"name": "f"}}), 400, "invalid_value",
     "tool_choice"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", with_(top_logprobs=2), 400,
     "invalid_value", ANY),
    ("top-logprobs-too-many", "/v1/chat/completions", with_(logprobs=True, top_logprobs=99),
     400, "invalid_value", "top_logprobs"),
    ("tool-message-without-id", "/v1/chat/completions",
     with_(messages=[{"role": "tool", "content": "42"}]), 400, "invalid_value",
     "messages.0.tool_call_id"),
    ("tool-call-id-on-a-user-message", "/v1/chat/completions",
     with_(messages=[{"role": "user", "content": "x", "tool_call_id": "c1"}]), 400,
     "unsupported_parameter", "messages.0.tool_call_id"),
    ("empty-content-parts", "/v1/chat/completions",
     with_(messages=[{"role": "user", "content": []}]), 400, "invalid_value",
     "messages.0.content"),
    ("token-id-outside-the-vocabulary", "/detokenize",
     json.dumps({"tokens": [1, 10**9]}).encode(), 400, "invalid_value", "tokens"),
    ("negative-token-id", "/v1/completions",
     json.dumps({"model": MODEL_ID, "prompt": [5, -1]}).encode(), 400, "invalid_value",
     "prompt.1"),
    ("logit-bias-bad-key", "/v1/chat/completions", with_(logit_bias={"hello": 1.0}), 400,
     "invalid_value", ANY),
    ("five-stops", "/v1/chat/completions", with_(stop=["a", "b", "c", "d", "e"]), 400,
     "invalid_value", ANY),
    ("echo", "/v1/completions",
     json.dumps({"model": MODEL_ID, "prompt": "x", "echo": True}).encode(), 400,
     "invalid_value", "echo"),
    ("best-of", "/v1/completions",
     json.dumps({"model": MODEL_ID, "prompt": "x", "best_of": 2}).encode(), 400,
     "unsupported_parameter", "best_of"),
    ("response-format-unknown-type", "/v1/chat/completions",
     with_(response_format={"type": "yaml"}), 400, "invalid_value", ANY),
    ("nested-thousands-deep", "/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 413,
     "request_too_large", ANY),
    ("nested-deep-under-limit", "/v1/chat/completions", b"[" * 30_000 + b"]" * 30_000, 400,
     "invalid_json", ANY),
    ("huge-integer", "/v1/chat/completions",
     with_().replace(b'"max_tokens": 1', b'"max_tokens": ' + b"9" * 5000), 400, None,
     ANY),
]  # fmt: skip


def assert_envelope(resp: httpx.Response, status: int, code: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"]
    if code is not None:
        assert err["code"] == code
    return dict(err)


def still_serving(server: ServerProcess) -> None:
    resp = httpx.post(server.url + "/v1/chat/completions", json=GOOD, timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [pytest.param(*c[1:], id=c[0]) for c in CASES],
)
def test_bad_request_gets_openai_error(
    server: ServerProcess, path: str, body: bytes, status: int, code: str, param: str | None
) -> None:
    resp = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    err = assert_envelope(resp, status, code)
    if param != ANY:
        assert err["param"] == param


def test_body_over_limit_is_413(server: ServerProcess) -> None:
    # The shared server runs with --max-body-bytes 65536.
    big = with_(messages=[{"role": "user", "content": "x" * 70_000}])
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        content=big,
        headers={"content-type": "application/json"},
    )
    assert_envelope(resp, 413, "request_too_large")
    still_serving(server)


def test_body_over_limit_without_content_length_is_413(server: ServerProcess) -> None:
    def chunks() -> Any:
        for _ in range(20):
            yield b" " * 4096  # JSON allows leading whitespace; 80 KiB in total
        yield with_()

    resp = httpx.post(
        server.url + "/v1/chat/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
    )
    assert_envelope(resp, 413, "request_too_large")


def test_prompt_beyond_context_is_context_length_exceeded(server: ServerProcess) -> None:
    # n_ctx is 512: about 600 tokens of prompt cannot fit, whatever max_tokens is.
    long = " ".join(["word"] * 600)
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        json=with_and(messages=[{"role": "user", "content": long}]),
    )
    err = assert_envelope(resp, 400, "context_length_exceeded")
    assert "512" in err["message"]


def test_prompt_plus_max_tokens_beyond_context(server: ServerProcess) -> None:
    # About 470 prompt tokens fit in n_ctx 512, but not with 60 more for the answer.
    prompt = " ".join(["word"] * 470)
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL_ID, "prompt": prompt, "max_tokens": 60},
    )
    assert_envelope(resp, 400, "context_length_exceeded")
    ok = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL_ID, "prompt": prompt, "max_tokens": 1},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert ok.status_code == 200, ok.text


def test_stream_request_errors_before_streaming(server: ServerProcess) -> None:
    long = " ".join(["word"] * 600)
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        json=with_and(messages=[{"role": "user", "content": long}], stream=True),
    )
    assert resp.headers["content-type"].startswith("application/json")
    assert_envelope(resp, 400, "context_length_exceeded")


def test_unknown_route_and_method_use_the_envelope(server: ServerProcess) -> None:
    assert_envelope(httpx.get(server.url + "/v1/nothing"), 404, None)
    assert_envelope(httpx.get(server.url + "/v1/chat/completions"), 405, None)


def test_server_keeps_serving_after_bad_input(server: ServerProcess) -> None:
    for _, path, body, *_ in CASES:
        httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    still_serving(server)


def with_and(**changes: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(with_(**changes))
    return out


def test_slow_clients_are_cut_off(serve_factory: Any) -> None:
    """Issue 12: the HTTP server had no header or body read timeout."""
    import socket
    import time

    from serveproc import scaled

    s = serve_factory("--header-timeout-s", "1", "--body-timeout-s", "1")

    def closed(sock: socket.socket) -> bytes:
        sock.settimeout(scaled(30))
        got = b""
        while True:  # read until the server closes the connection
            chunk = sock.recv(4096)
            if not chunk:
                return got
            got += chunk

    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never end
        started = time.monotonic()
        assert closed(sock) == b""
        assert time.monotonic() - started < scaled(30)
    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"mo'
        )
        answer = closed(sock)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b'"request_timeout"' in answer
    still_serving(s)
