"""HTTP/1.1 on the wire to one peer: the engine child, over its unix socket.

Owns the framing of one exchange per connection (``Connection: close``,
:func:`exchange`): the request written, the status line and headers read
(bounded), the body by ``Content-Length``, chunked transfer coding or until the
peer closes, checked not guessed (see :class:`Answer`). Every failure is a
:class:`WireError` saying whether any byte of an answer arrived, so a request
the peer never took may be sent once more. It times nothing out (a peer that
stops mid-answer is a stall: :mod:`slmguard.serve.liveness` aborts it) and knows
no route or JSON (:mod:`slmguard.serve.upstream`'s). Not an HTTP library: the
front reads every streamed token here, and a general client's layers cost the
engine's threads more per token (``benchmarks/serve_overhead.py``).

Example::

    answer = await exchange(Path("engine.sock"), "GET", "/health", {}, b"")
    body = await answer.read_all(1 << 20)
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

MAX_HEAD_LINE_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 64 * 1024 * 1024
MAX_HEADERS = 100
MAX_CHUNK_LINE_BYTES = 1024
READ_BYTES = 64 * 1024
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})(;[^\r\n]*)?\r\n")


class WireError(Exception):
    """The exchange broke; ``answered`` is False when not one byte of an answer came,
    ``connected`` False when not even the connection was made (nothing listens yet)."""

    def __init__(self, message: str, *, answered: bool, connected: bool = True) -> None:
        super().__init__(message)
        self.answered = answered
        self.connected = connected


class Answer:
    """One response being read: status and headers now, the body as it comes.

    The framing is checked, not guessed: a chunk size is plain hex digits (an
    optional ``;extension`` after them), each chunk's data ends in CRLF, the
    trailer after the last chunk has at most :data:`MAX_HEADERS` lines, and a
    ``Content-Length`` is plain decimal digits; anything else is a malformed answer.
    """

    def __init__(
        self,
        status: int,
        headers: dict[str, str],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.status = status
        self.headers = headers  # names in lower case
        self._reader = reader
        self._writer = writer

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body in the pieces the peer sent (chunked) or as read (otherwise)."""
        reader = self._reader
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                async for data in _dechunk(reader):
                    yield data
            elif "content-length" in self.headers:
                value = self.headers["content-length"]
                if not value.isascii() or not value.isdigit():
                    raise ValueError(f"Content-Length {value[:40]!r}")
                left = int(value)
                while left > 0:
                    data = await reader.read(min(left, READ_BYTES))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    yield data
            else:
                while data := await reader.read(READ_BYTES):
                    yield data
        except asyncio.IncompleteReadError as err:
            raise WireError("the peer closed the connection mid-answer", answered=True) from err
        except (asyncio.LimitOverrunError, ValueError) as err:
            raise WireError(f"a malformed answer body ({err})", answered=True) from err
        except OSError as err:
            raise WireError(f"{type(err).__name__}: {err}", answered=True) from err

    async def read_all(self, limit_bytes: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        async for data in self.chunks():
            total += len(data)
            if total > limit_bytes:
                raise WireError(f"the answer is over {limit_bytes} bytes", answered=True)
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        """Drop the connection (how a streamed generation is cancelled)."""
        self._writer.close()


async def _dechunk(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The chunks of a chunked body, parsed out of whatever each read brings: one read
    (one await) per arrival, however many chunks it holds, none per chunk beyond it (the
    engine sends a chunk per streamed token)."""
    buf = b""
    at = 0
    while True:
        end = buf.find(b"\n", at)
        if end < 0:
            if len(buf) - at > MAX_CHUNK_LINE_BYTES:
                raise WireError("a chunk size line is too long", answered=True)
        else:
            size = _size_of(buf[at : end + 1])
            if size == 0:
                break
            stop = end + 1 + size
            if len(buf) < stop + 2:  # the rest of this chunk, in one read
                buf = buf[at:] + await reader.readexactly(stop + 2 - len(buf))
                end, stop, at = end - at, stop - at, 0
            if buf[stop : stop + 2] != b"\r\n":
                raise ValueError("a chunk does not end in CRLF")
            yield buf[end + 1 : stop]
            at = stop + 2
            continue
        more = await reader.read(READ_BYTES)
        if not more:
            raise asyncio.IncompleteReadError(buf[at:], None)
        buf = buf[at:] + more
        at = 0
    # The trailer after the last chunk: up to an empty line, at most MAX_HEADERS lines.
    at = end + 1
    for _ in range(MAX_HEADERS + 1):
        while (end := buf.find(b"\n", at)) < 0:
            if len(buf) - at > MAX_HEAD_LINE_BYTES:
                raise ValueError("a trailer line is too long")
            more = await reader.read(READ_BYTES)
            if not more:
                raise asyncio.IncompleteReadError(buf[at:], None)
            buf = buf[at:] + more
            at = 0
        line, at = buf[at : end + 1], end + 1
        if not line.strip():
            return
    raise ValueError(f"over {MAX_HEADERS} trailer lines")


def _size_of(line: bytes) -> int:
    """A chunk size line: hex digits, maybe an extension, CRLF (0: the last chunk)."""
    if len(line) > MAX_CHUNK_LINE_BYTES:
        raise WireError("a chunk size line is too long", answered=True)
    match = _CHUNK_SIZE.fullmatch(line)
    if match is None:
        raise ValueError(f"the chunk size line {line[:40]!r}")
    size = int(match.group(1), 16)
    if size > MAX_CHUNK_BYTES:
        raise WireError(f"a chunk of {size} bytes", answered=True)
    return size


async def exchange(
    socket_path: Path,
    method: str,
    target: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    connect_timeout_s: float = 5.0,
) -> Answer:
    """Send one request on a new connection and read the answer's head."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(socket_path), limit=MAX_HEAD_LINE_BYTES),
            connect_timeout_s,
        )
    except (OSError, asyncio.exceptions.TimeoutError) as err:
        raise WireError(
            f"cannot connect: {type(err).__name__}: {err}", answered=False, connected=False
        ) from err
    try:
        head = [f"{method} {target} HTTP/1.1", "Host: engine", "Connection: close"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        head.append(f"Content-Length: {len(body)}")
        try:
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
        except (OSError, RuntimeError) as err:
            # uvloop raises RuntimeError ("the handler is closed") where asyncio raises an
            # OSError: the engine closed the connection (killed) before the request went.
            raise WireError(f"sending: {type(err).__name__}: {err}", answered=False) from err
        return await _read_head(reader, writer)
    except BaseException:
        writer.close()
        raise


async def _read_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Answer:
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as err:
        if not err.partial:
            raise WireError("the peer closed without sending a response", answered=False) from err
        raise WireError("the peer closed mid-status-line", answered=True) from err
    except ConnectionResetError as err:
        raise WireError("the peer reset without sending a response", answered=False) from err
    except BrokenPipeError as err:
        raise WireError("the peer closed before the request was sent", answered=False) from err
    except (OSError, asyncio.LimitOverrunError, ValueError) as err:
        raise WireError(f"a malformed status line ({err})", answered=True) from err
    parts = line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise WireError(f"not an HTTP/1.x status line: {line[:80]!r}", answered=True)
    headers: dict[str, str] = {}
    try:
        for _ in range(MAX_HEADERS + 1):
            raw = await reader.readuntil(b"\n")
            text = raw.decode("latin-1").strip()
            if not text:
                return Answer(int(parts[1]), headers, reader, writer)
            name, sep, value = text.partition(":")
            if not sep:
                raise WireError(f"a malformed header line: {text[:80]!r}", answered=True)
            headers[name.strip().lower()] = value.strip()
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as err:
        raise WireError(f"a broken answer head ({err})", answered=True) from err
    raise WireError(f"over {MAX_HEADERS} header lines", answered=True)
