"""The front's engine client over a real unix socket: a connection the engine closes
before answering is sent once more; one closed mid-answer, or closed twice, is an error."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from slmguard.serve.upstream import EngineClient, EngineUnreachable

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
    with pytest.raises(EngineUnreachable, match="without sending a response"):
        _run(tmp_path, [None, None], call)


def test_an_answer_cut_short_is_not_sent_again(tmp_path: Path) -> None:
    cut = ANSWER[:-4]  # headers promise 11 bytes; 7 arrive, then the connection closes
    with pytest.raises(EngineUnreachable):
        _run(tmp_path, [cut], "request")
