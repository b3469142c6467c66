"""The front's HTTP/1.1 protocol (serve/runner.py) on both parsers uvicorn has, h11 and
httptools: slow and oversized request headers are cut off, a body that arrives with its
headers is not taken for headers, keep-alive and a chunked stream still work. A real
uvicorn server in this process, on a loopback socket, with a small ASGI app (no engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from slmguard.serve.runner import (
    HEADER_BYTES_MAX,
    http_protocol,
    quiet_exit_server,
    run_loop,
    stack_name,
    timed_protocol,
)
from waiting import scaled, wait_for

BASES = {"h11": H11Protocol, "httptools": HttpToolsProtocol}
_TOO_LARGE = {"h11": b"HTTP/1.1 400", "httptools": b"HTTP/1.1 431"}


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Echoes the body's length; ``/stream`` answers three chunks."""
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(3):
            await send({"type": "http.response.body", "body": b"data: %d\n\n" % i,
                        "more_body": True})  # fmt: skip
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    body = str(size).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def _serving(base: Any, header_timeout_s: float = 60.0) -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    config = uvicorn.Config(
        _app, log_level="warning", lifespan="off", http=timed_protocol(header_timeout_s, base)
    )
    server = quiet_exit_server(uvicorn.Server)(config)
    thread = threading.Thread(target=run_loop, args=(server.serve(sockets=[sock]),))
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "the test server to start")
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(scaled(30))
        sock.close()


def _closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(scaled(30))
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def _post(path: str, body: bytes, *, extra: bytes = b"") -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n" % (
        path.encode(), extra, len(body))  # fmt: skip
    return head + body


@pytest.mark.parametrize("name", sorted(BASES))
def test_headers_that_never_end_are_cut_off(name: str) -> None:
    with (
        _serving(BASES[name], header_timeout_s=1) as port,
        socket.create_connection(("127.0.0.1", port)) as sock,
    ):
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")
        assert _closed(sock) == b""


@pytest.mark.parametrize("name", sorted(BASES))
def test_headers_past_the_limit_get_431_and_the_connection_closed(name: str) -> None:
    line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
    head = b"POST / HTTP/1.1\r\nHost: x\r\n" + line * (3 * HEADER_BYTES_MAX // 2 // len(line))
    with _serving(BASES[name]) as port, socket.create_connection(("127.0.0.1", port)) as sock:
        with contextlib.suppress(OSError):  # the server may close while we still send
            sock.sendall(head)  # headers that never end: only the limit ends them early
        try:
            answer = _closed(sock)
        except ConnectionResetError:
            # The server closed with some of our bytes unread, and the kernel reset the
            # connection, dropping its answer: it was cut off all the same. (Without the
            # limit, httptools waits for the rest until the header timeout, 60 s here, and
            # closes without a word.)
            return
        # h11 refuses at its own limit (16 KiB) with a 400 of its own; httptools keeps every
        # header it is given, and the limit here refuses them.
        assert answer.startswith(_TOO_LARGE[name]), answer[:200]


@pytest.mark.parametrize("name", sorted(BASES))
def test_a_large_body_sent_with_its_headers_is_not_taken_for_headers(name: str) -> None:
    body = b"x" * (8 * HEADER_BYTES_MAX)
    with _serving(BASES[name]) as port, socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_post("/", body, extra=b"Connection: close\r\n"))
        answer = _closed(sock)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert answer.endswith(str(len(body)).encode())


@pytest.mark.parametrize("name", sorted(BASES))
def test_headers_near_the_limit_on_each_keep_alive_request_are_served(name: str) -> None:
    # The limit is per request: three requests of 3/4 of it on one connection pass.
    filler = b"X-Filler: " + b"a" * (3 * HEADER_BYTES_MAX // 4) + b"\r\n"
    with _serving(BASES[name]) as port, socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(scaled(30))
        for _ in range(3):
            sock.sendall(_post("/", b"abc", extra=filler))
            got = b""
            while not got.endswith(b"\r\n\r\n3"):
                chunk = sock.recv(65536)
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 200"), got[:200]


@pytest.mark.parametrize("name", sorted(BASES))
def test_a_stream_is_sent_chunked(name: str) -> None:
    with _serving(BASES[name]) as port, socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_post("/stream", b"", extra=b"Connection: close\r\n"))
        answer = _closed(sock)
        assert answer.startswith(b"HTTP/1.1 200")
        assert b"transfer-encoding: chunked" in answer.lower()
        for i in range(3):
            assert b"data: %d\n\n" % i in answer
        assert answer.endswith(b"0\r\n\r\n")


def test_the_front_serves_with_httptools_on_uvloop_when_installed() -> None:
    # Both are dependencies of the serve extra (pyproject.toml): the faster stack is the
    # one the front runs; h11 and asyncio are the fallbacks where they are missing.
    import uvloop

    assert http_protocol() is HttpToolsProtocol
    assert stack_name() == "httptools on uvloop"

    async def loop_class() -> type:
        return type(asyncio.get_running_loop())

    assert run_loop(loop_class()) is uvloop.Loop
