"""The floor of an ASGI relay: what uvicorn, as the front runs it, costs per token.

A reference for ``benchmarks/serve_overhead.py --asgi-floor``, not a server: one
ASGI callable under uvicorn with the front's HTTP stack (slmguard.serve.runner's
protocol and event loop: httptools and uvloop where installed). Each request goes
to the bare llama-server on a new connection (``Connection: close``); the answer's
chunked body is parsed chunk by chunk and each chunk handed to uvicorn's ``send``,
which frames it again for the client. No framework above ASGI, no parsing of the
events, no validation, no bookkeeping. Between ``floor_relay.py`` (raw bytes) and
the front, this separates what the ASGI server costs from what the guard costs.

Usage: asgi_floor.py LISTEN_PORT UPSTREAM_PORT
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn

from slmguard.serve.runner import http_protocol, run_loop

Send = Callable[[dict[str, Any]], Awaitable[None]]


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


def app_for(upstream: int) -> Callable[..., Awaitable[None]]:
    async def app(scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        reader, writer = await asyncio.open_connection("127.0.0.1", upstream)
        head = [f"{scope['method']} {scope['path']} HTTP/1.1", "Host: engine",
                "Connection: close", "Content-Type: application/json",
                f"Content-Length: {len(body)}"]  # fmt: skip
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        status = int((await reader.readuntil(b"\r\n")).split()[1])
        headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        if b"transfer-encoding: chunked" in headers:
            async for chunk in _chunks(reader):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        else:
            await send({"type": "http.response.body", "body": await reader.read(),
                        "more_body": True})  # fmt: skip
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        writer.close()

    return app


def main(port: int, upstream: int) -> None:
    config = uvicorn.Config(app_for(upstream), host="127.0.0.1", port=port,
                            http=http_protocol(), log_level="warning", access_log=False,
                            lifespan="off")  # fmt: skip
    run_loop(uvicorn.Server(config).serve())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("port", type=int)
    ap.add_argument("upstream", type=int)
    args = ap.parse_args()
    main(args.port, args.upstream)
