"""serve/http1.py against a peer that goes away: every failure is a WireError."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import uvloop

from slmguard.serve import http1


def test_an_engine_killed_with_our_connection_in_its_backlog_is_a_wire_error(
    tmp_path: Path,
) -> None:
    """The sixth neighbour series' run 3 (issue 39): the governor killed a loading engine
    while the supervisor polled its /health; the connection was in the engine's listen
    backlog, the kernel reset it, uvloop (the server's loop) closed the transport on the
    reset and then refused our write with RuntimeError ("the handler is closed"). That
    error ended the supervisor's task. Here the engine's socket is a real listener that
    never accepts and is closed a few loop turns after the connect starts, for every
    turn at which the reset can land: before the connect, between it and the write, after
    the write. Each is a WireError that says nothing was answered; one of them is the
    refused write, or the test would not exercise it."""
    path = tmp_path / "engine.sock"

    async def killed_after(turns: int) -> http1.WireError:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path.unlink(missing_ok=True)
        listener.bind(str(path))
        listener.listen(8)
        request = asyncio.ensure_future(http1.exchange(path, "GET", "/health", {}, b""))
        for _ in range(turns):
            await asyncio.sleep(0)
        listener.close()  # the engine's end: its backlog is reset
        try:
            await request
        except http1.WireError as err:
            return err
        raise AssertionError(f"an answer from a closed listener after {turns} turns")

    async def main() -> list[http1.WireError]:
        return [await killed_after(turns) for turns in range(12)]

    errors = uvloop.run(main())
    assert not any(err.answered for err in errors)
    messages = [str(err) for err in errors]
    assert any(m.startswith("sending: RuntimeError") for m in messages), messages
