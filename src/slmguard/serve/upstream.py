"""The front's HTTP client to its engine child, over the child's private unix socket.

Owns the one ``httpx.AsyncClient`` the front uses to talk to llama-server:
the socket transport, the per-start API key, timeouts, and the translation
of transport failures into :class:`EngineUnreachable` (the engine died, was
restarted, or does not answer), so callers never see httpx's own exceptions.
A new client is made at every engine start (:meth:`EngineClient.reset`):
pooled connections to a dead child would otherwise fail the next requests.

Example::

    client = EngineClient(Path("/run/slmguard/engine.sock"))
    await client.reset(api_key)
    status, body = await client.post_json("/tokenize", {"content": "Hi"})
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

BASE_URL = "http://engine"


class EngineUnreachable(Exception):
    """The engine did not answer: not running, restarting, or the connection broke."""


class EngineClient:
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._http: httpx.AsyncClient | None = None
        self._key: str | None = None

    async def reset(self, api_key: str) -> None:
        """Forget every pooled connection and use ``api_key`` from now on."""
        import httpx

        await self.aclose()
        self._key = api_key
        self._http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(self.socket_path)),
            base_url=BASE_URL,
            # No read timeout by default: a long prefill on a slow board is not an
            # error here (the liveness check decides what a stall is).
            timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
        )

    async def aclose(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.aclose()

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise EngineUnreachable("the engine has not been started")
        return self._http

    def headers(self, auth: bool = True) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._key}"} if auth and self._key else {}

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
        import httpx

        kwargs: dict[str, Any] = {"headers": self.headers(auth)}
        if body is not None:
            kwargs["content"] = json.dumps(body, ensure_ascii=False).encode("utf-8")
            kwargs["headers"]["Content-Type"] = "application/json"
        if timeout_s is not None:
            kwargs["timeout"] = httpx.Timeout(timeout_s)
        try:
            resp = await self._client().request(method, path, **kwargs)
        except (httpx.TransportError, httpx.StreamError) as err:
            raise EngineUnreachable(f"{method} {path}: {type(err).__name__}: {err}") from err
        return resp.status_code, resp.content, resp.headers.get("content-type", "")

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
    async def stream(self, path: str, body: Any) -> AsyncIterator[httpx.Response]:
        """POST ``body`` and yield the response before its body is read (SSE relay).

        Leaving the block closes the connection, which is how a generation is
        cancelled: llama-server stops a task whose client went away.
        """
        import httpx

        headers = {**self.headers(), "Content-Type": "application/json"}
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        try:
            async with self._client().stream("POST", path, content=data, headers=headers) as resp:
                yield resp
        except (httpx.TransportError, httpx.StreamError) as err:
            raise EngineUnreachable(f"POST {path}: {type(err).__name__}: {err}") from err


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        return None
