"""The floor of a Python relay: what any asyncio process costs per token it passes on.

A reference for ``benchmarks/serve_overhead.py --floor``, not a server: it accepts
HTTP/1.1 requests on loopback, sends each one to the bare llama-server (its
``Connection`` header replaced by ``close``) and copies the answer back as the bytes
arrive, chunked framing included. No framework, no parsing of the answer, no
validation, no bookkeeping: one read and one write per chunk the engine sends. The
front's CPU per token over this floor's is what the framework and the guard cost.
It runs on the event loop the front runs on: uvloop where it is installed (the serve
extra's), else asyncio's own; ``--loop`` chooses.

Usage: floor_relay.py LISTEN_PORT UPSTREAM_PORT [--loop uvloop|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util


async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: int) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = [line for line in head.split(b"\r\n") if line]
            length = 0
            for line in lines:
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = await reader.readexactly(length)
            kept = [line for line in lines if not line.lower().startswith(b"connection:")]
            up_r, up_w = await asyncio.open_connection("127.0.0.1", upstream)
            up_w.write(b"\r\n".join(kept) + b"\r\nConnection: close\r\n\r\n" + body)
            await up_w.drain()
            while data := await up_r.read(65536):
                writer.write(data)
                await writer.drain()
            up_w.close()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def main(port: int, upstream: int) -> None:
    server = await asyncio.start_server(lambda r, w: relay(r, w, upstream), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def default_loop() -> str:
    """The front's event loop (slmguard.serve.runner.run_loop): uvloop when installed."""
    return "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("port", type=int)
    ap.add_argument("upstream", type=int)
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default=default_loop())
    args = ap.parse_args()
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(main(args.port, args.upstream))
    else:
        asyncio.run(main(args.port, args.upstream))
