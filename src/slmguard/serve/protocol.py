"""The wire between the API front and the engine worker.

Owns the framing and the message vocabulary; knows nothing about HTTP or the
engine. A frame is a 4-byte big-endian length followed by that many bytes of
UTF-8 JSON (one object with an ``op`` key). One token costs one frame of about
60 bytes and one ``json.dumps``: a few microseconds against ~28 ms of decode
per token on the target boards, far below the 2% budget. Nothing is batched:
the worker writes each piece of text as soon as the engine produces it.

Front -> worker::

    {"op": "load", ...EngineConfig fields}          load (or reload) the engine
    {"op": "generate", "id", "prompt", "add_bos", "special", "max_tokens",
     "max_tokens_cap", "temperature", "top_p", "top_k", "stop", "seed"}
                                                     prompt: a string, or [[text, special], ...]
    {"op": "cancel", "id"}                           stop that generation before its next token
    {"op": "reset_cache"}                            forget the cached prompt prefix
    {"op": "shutdown"}

Worker -> front::

    {"op": "loaded", "n_ctx", "n_vocab", "eos_token", "pid", "load_s"}
    {"op": "load_failed", "message"}
    {"op": "start", "id", "prompt_tokens", "max_tokens"}   prompt tokenized and admitted
    {"op": "text", "id", "text", "n"}                      n = completion tokens so far
    {"op": "done", "id", "finish_reason", "prompt_tokens", "completion_tokens"}
    {"op": "error", "id", "code", "message"}               code: context_length_exceeded,
                                                           cancelled (with "n"), engine_error
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from dataclasses import asdict, dataclass
from typing import Any

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20

Message = dict[str, Any]


class ProtocolError(Exception):
    """A frame was malformed or too large (the peer is not speaking this protocol)."""


@dataclass(frozen=True)
class EngineConfig:
    """What the worker needs to create the engine; sent in the ``load`` message."""

    model_path: str
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_threads: int
    kv_type: str = "f16"
    use_mmap: bool = True
    use_mlock: bool = False

    def to_message(self) -> Message:
        return {"op": "load", **asdict(self)}

    @classmethod
    def from_message(cls, msg: Message) -> EngineConfig:
        return cls(**{k: msg[k] for k in cls.__dataclass_fields__ if k in msg})


def encode(msg: Message) -> bytes:
    body = json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> Message:
    try:
        msg = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProtocolError(f"undecodable frame: {err}") from err
    if not isinstance(msg, dict) or "op" not in msg:
        raise ProtocolError("frame is not an object with an 'op'")
    return msg


def _check_length(n: int) -> int:
    if n > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    return n


# Blocking side (the worker).


def send_blocking(sock: socket.socket, msg: Message) -> None:
    sock.sendall(encode(msg))


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_blocking(sock: socket.socket) -> Message | None:
    """The next message, or None at end of stream."""
    head = _recv_exact(sock, HEADER.size)
    if head is None:
        return None
    body = _recv_exact(sock, _check_length(HEADER.unpack(head)[0]))
    if body is None:
        return None
    return decode_body(body)


# Asyncio side (the front).


async def recv_async(reader: asyncio.StreamReader) -> Message | None:
    """The next message, or None at end of stream (the worker is gone)."""
    try:
        head = await reader.readexactly(HEADER.size)
        body = await reader.readexactly(_check_length(HEADER.unpack(head)[0]))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return decode_body(body)
