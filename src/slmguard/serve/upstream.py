"""The front's HTTP client to its engine child, over the child's private unix socket.

Owns the one connection pool (``httpcore``) the front uses to talk to llama-server:
the socket transport, the per-start API key, timeouts, and the translation
of transport failures into :class:`EngineUnreachable` (the engine died, was
restarted, or does not answer), so callers never see httpcore's own exceptions.
A new client is made at every engine start (:meth:`EngineClient.reset`):
pooled connections to a dead child would otherwise fail the next requests.

Example::

    client = EngineClient(Path("/run/slmguard/engine.sock"))
    await client.reset(api_key)
    status, body = await client.post_json("/tokenize", {"content": "Hi"})
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpcore

log = logging.getLogger(__name__)

BASE_URL = "http://engine"


class EngineUnreachable(Exception):
    """The engine did not answer: not running, restarting, or the connection broke."""


class EngineClient:
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._pool: httpcore.AsyncConnectionPool | None = None
        self._key: str | None = None

    async def reset(self, api_key: str) -> None:
        """Forget every pooled connection and use ``api_key`` from now on."""
        import httpcore

        await self.aclose()
        self._key = api_key
        # httpcore, not httpx: the front needs HTTP/1.1 over one unix socket and
        # nothing of httpx's client on top, whose import (with its command line's
        # rich and click when they are installed) costs the front ~9 MiB.
        self._pool = httpcore.AsyncConnectionPool(
            uds=str(self.socket_path),
            # No kept-alive connections: llama-server's HTTP library gives each open
            # connection one of its few HTTP threads and closes one idle for 5 s, so a
            # pool would both starve concurrent requests of threads and race that
            # close (a request sent on a connection being closed fails as a 503 with
            # the engine ready). A new connection over the unix socket costs
            # microseconds.
            max_keepalive_connections=0,
            http1=True,
            http2=False,
        )

    async def aclose(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.aclose()

    def _client(self) -> httpcore.AsyncConnectionPool:
        if self._pool is None:
            raise EngineUnreachable("the engine has not been started")
        return self._pool

    def headers(self, auth: bool = True) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._key}"} if auth and self._key else {}

    def _args(self, body: Any, timeout_s: float | None, auth: bool) -> dict[str, Any]:
        headers = {"Host": "engine", **self.headers(auth)}
        args: dict[str, Any] = {}
        if body is not None:
            args["content"] = json.dumps(body, ensure_ascii=False).encode("utf-8")
            headers["Content-Type"] = "application/json"
        args["headers"] = list(headers.items())
        # No read timeout by default: a long prefill on a slow board is not an
        # error here (the liveness check decides what a stall is).
        args["extensions"] = {
            "timeout": {"connect": 5.0, "read": None, "write": 30.0, "pool": None}
            if timeout_s is None
            else dict.fromkeys(("connect", "read", "write", "pool"), timeout_s)
        }
        return args

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout_s: float | None = None,
        auth: bool = True,
    ) -> tuple[int, bytes, str]:
        """One request; returns (status, body bytes, content type)."""
        import httpcore

        args = self._args(body, timeout_s, auth)
        for attempt in (1, 2):
            try:
                resp = await self._client().request(method, BASE_URL + path, **args)
            except httpcore.RemoteProtocolError as err:
                if attempt == 1 and _never_answered(err):
                    continue
                raise _unreachable(method, path, err) from err
            except _transport_errors() as err:
                raise _unreachable(method, path, err) from err
            break
        return resp.status, resp.content, _header(resp.headers, b"content-type")

    async def get_json(
        self, path: str, *, timeout_s: float | None = None, auth: bool = True
    ) -> tuple[int, Any]:
        status, raw, _ = await self.request("GET", path, timeout_s=timeout_s, auth=auth)
        return status, _json(raw)

    async def post_json(
        self, path: str, body: Any, *, timeout_s: float | None = None
    ) -> tuple[int, Any]:
        status, raw, _ = await self.request("POST", path, body, timeout_s=timeout_s)
        return status, _json(raw)

    @asynccontextmanager
    async def stream(self, path: str, body: Any) -> AsyncIterator[EngineStream]:
        """POST ``body`` and yield the response before its body is read (SSE relay).

        Leaving the block closes the connection, which is how a generation is
        cancelled: llama-server stops a task whose client went away.
        """
        import httpcore

        args = self._args(body, None, True)
        pool = self._client()
        try:
            try:
                opened = pool.stream("POST", BASE_URL + path, **args)
                resp = await opened.__aenter__()
            except httpcore.RemoteProtocolError as err:
                if not _never_answered(err):
                    raise
                opened = pool.stream("POST", BASE_URL + path, **args)
                resp = await opened.__aenter__()
            try:
                yield EngineStream(resp)
            finally:
                await opened.__aexit__(None, None, None)
        except _transport_errors() as err:
            raise _unreachable("POST", path, err) from err


class EngineStream:
    """A streamed answer of the engine: its status, then its body whole or by lines."""

    def __init__(self, resp: httpcore.Response) -> None:
        self._resp = resp
        self.status_code = resp.status

    async def aread(self) -> bytes:
        return await self._resp.aread()

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's lines without their ends (SSE lines end in LF, maybe CR LF)."""
        pending = b""
        async for chunk in self._resp.aiter_stream():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.removesuffix(b"\r").decode("utf-8", errors="replace")
        if pending:
            yield pending.removesuffix(b"\r").decode("utf-8", errors="replace")


def _transport_errors() -> tuple[type[Exception], ...]:
    import httpcore

    return (httpcore.NetworkError, httpcore.ProtocolError, httpcore.TimeoutException)


def _unreachable(method: str, path: str, err: Exception) -> EngineUnreachable:
    return EngineUnreachable(f"{method} {path}: {type(err).__name__}: {err}")


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


def _never_answered(err: Exception) -> bool:
    """The connection closed before a single byte of the answer: the request was not
    taken (llama-server now and then closes a new connection so, as a generation on
    another connection ends), and sending it once more on a new connection is safe."""
    if "without sending a response" not in str(err):
        return False
    log.info("the engine closed a connection without answering; sending the request again")
    return True


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        return None
