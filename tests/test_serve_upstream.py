"""The front's engine client over a real unix socket: a connection the engine closes
before answering is sent once more; one closed mid-answer, or closed twice, is an error."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from slmguard.errors import EngineUnreachableError
from slmguard.serve.upstream import EngineClient

ANSWER = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'
)


async def _engine(sock: Path, script: list[bytes | None]) -> asyncio.AbstractServer:
    """A fake engine: connection i reads a request and writes script[i] (None: closes
    without a byte), then closes. Past the script it answers ANSWER."""
    seen = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        action = script[seen] if seen < len(script) else ANSWER
        seen += 1
        await reader.readuntil(b"\r\n\r\n")
        if action is not None:
            writer.write(action)
            await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(handle, path=str(sock))


def _run(tmp_path: Path, script: list[bytes | None], call: str) -> object:
    sock = tmp_path / "engine.sock"

    async def scenario() -> object:
        server = await _engine(sock, script)
        client = EngineClient(sock)
        await client.reset("key")
        try:
            if call == "request":
                return await client.request("GET", "/health")
            async with client.stream("/completion", {"prompt": "x"}) as resp:
                return resp.status_code, await resp.aread()
        finally:
            await client.aclose()
            server.close()

    return asyncio.run(scenario())


@pytest.mark.parametrize("call", ["request", "stream"])
def test_a_connection_closed_before_any_answer_is_sent_again(tmp_path: Path, call: str) -> None:
    got = _run(tmp_path, [None], call)
    if call == "request":
        assert got == (200, b'{"ok":true}', "application/json")
    else:
        assert got == (200, b'{"ok":true}')


@pytest.mark.parametrize("call", ["request", "stream"])
def test_twice_unanswered_is_unreachable(tmp_path: Path, call: str) -> None:
    with pytest.raises(EngineUnreachableError, match="without sending a response"):
        _run(tmp_path, [None, None], call)


def test_an_answer_cut_short_is_not_sent_again(tmp_path: Path) -> None:
    cut = ANSWER[:-4]  # headers promise 11 bytes; 7 arrive, then the connection closes
    with pytest.raises(EngineUnreachableError):
        _run(tmp_path, [cut], "request")


def test_a_stream_is_read_by_lines_across_chunks(tmp_path: Path) -> None:
    sock = tmp_path / "engine.sock"
    body = [b'data: {"a"', b": 1}\n\nda", "ta: é\r\n".encode(), b"\ndata: [DONE]"]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
        for piece in body:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def scenario() -> list[str]:
        server = await asyncio.start_unix_server(handle, path=str(sock))
        client = EngineClient(sock)
        await client.reset("key")
        try:
            async with client.stream("/completion", {"prompt": "x"}) as resp:
                assert resp.status_code == 200
                return [line async for line in resp.aiter_lines()]
        finally:
            await client.aclose()
            server.close()

    assert asyncio.run(scenario()) == ['data: {"a": 1}', "", "data: é", "", "data: [DONE]"]


def test_the_engine_gone_is_unreachable(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        client = EngineClient(tmp_path / "nobody.sock")
        await client.reset("key")
        try:
            await client.request("GET", "/health")
        finally:
            await client.aclose()

    with (
        caplog.at_level(logging.DEBUG, logger="slmguard.serve.upstream"),
        pytest.raises(EngineUnreachableError, match="GET /health: cannot connect"),
    ):
        asyncio.run(scenario())
    # No socket yet is every start's first poll: below INFO, not a line a user reads as an
    # error ("the engine did not answer (cannot connect: FileNotFoundError ...)").
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said and all(level == logging.DEBUG for level, _ in said), said
    assert "FileNotFoundError" in said[0][1]


def test_a_connection_closed_unanswered_is_said_at_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine took the connection and closed it: not expected, so INFO (and sent again)."""
    with caplog.at_level(logging.DEBUG, logger="slmguard.serve.upstream"):
        assert _run(tmp_path, [None], "request") == (200, b'{"ok":true}', "application/json")
    assert [r.levelno for r in caplog.records] == [logging.INFO]


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_a_chunked_answer_with_extensions_and_a_trailer_is_read(tmp_path: Path) -> None:
    answer = CHUNKED + b"2;name=v\r\nok\r\nA\r\n0123456789\r\n0\r\nX-T: 1\r\n\r\n"
    assert _run(tmp_path, [answer], "request") == (200, b"ok0123456789", "")


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"SMTP 220 hello\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", "over 100 header lines"),
        (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", "broken answer head"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed answer"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7fffffff\r\n", "a chunk of"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n", "malformed answer"),
        # Only plain decimal lengths and plain hex chunk sizes: int() would take these.
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1_1\r\n\r\n" + b"x" * 11, "Content-Length"),
        (CHUNKED + b"0x2\r\nok\r\n0\r\n\r\n", "the chunk size line"),
        (CHUNKED + b"+2\r\nok\r\n0\r\n\r\n", "the chunk size line"),
        (CHUNKED + b" 2\r\nok\r\n0\r\n\r\n", "the chunk size line"),
        (CHUNKED + b"2\nok\r\n0\r\n\r\n", "the chunk size line"),  # LF alone
        # Each chunk's data ends in CRLF: here the size says 2 and 3 bytes came.
        (CHUNKED + b"2\r\nokk\r\n0\r\n\r\n", "does not end in CRLF"),
        # The trailer is bounded like the head.
        (CHUNKED + b"2\r\nok\r\n0\r\n" + b"X-T: 1\r\n" * 101 + b"\r\n", "trailer lines"),
    ],
)
def test_a_malformed_answer_is_unreachable_not_retried(
    tmp_path: Path, answer: bytes, error: str
) -> None:
    with pytest.raises(EngineUnreachableError, match=error):
        _run(tmp_path, [answer], "request")


def test_a_body_to_the_close_is_read_whole(tmp_path: Path) -> None:
    got = _run(tmp_path, [b"HTTP/1.1 404 Not Found\r\n\r\nno such route"], "request")
    assert got == (404, b"no such route", "")


@pytest.mark.parametrize("piece", [1, 7, 1 << 20])
def test_a_chunked_body_split_anywhere_or_all_at_once_reads_the_same(
    tmp_path: Path, piece: int
) -> None:
    # The chunks are parsed out of whatever each read brings: a size line, its data or
    # the trailer cut between reads, or many chunks (and a large one) in one read.
    big = bytes(range(256)) * 4096  # 1 MiB in one chunk
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (b"data: 1\n\n", big, b"xy"))
    answer = CHUNKED + body + b"0\r\nX-T: 1\r\n\r\n"
    sock = tmp_path / "engine.sock"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for at in range(0, len(answer), piece):
            writer.write(answer[at : at + piece])
            if (piece < 1024 and at < 4096) or at > len(answer) - 4096:
                await writer.drain()
                await asyncio.sleep(0)  # let the reader take this piece alone
        await writer.drain()
        writer.close()

    async def scenario() -> bytes:
        server = await asyncio.start_unix_server(handle, path=str(sock))
        client = EngineClient(sock)
        await client.reset("key")
        try:
            return (await client.request("GET", "/x"))[1]
        finally:
            await client.aclose()
            server.close()

    assert asyncio.run(scenario()) == b"data: 1\n\n" + big + b"xy"
