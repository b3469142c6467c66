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
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

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
            # Plain HTTP over a unix socket: no TLS, so no certificate store either
            # (loading one costs the front 3 MiB for nothing).
            transport=httpx.AsyncHTTPTransport(uds=str(self.socket_path), verify=False),
            verify=False,
            base_url=BASE_URL,
            # No read timeout by default: a long prefill on a slow board is not an
            # error here (the liveness check decides what a stall is).
            timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
            # No kept-alive connections: llama-server's HTTP library gives each open
            # connection one of its few HTTP threads and closes one idle for 5 s, so a
            # pool would both starve concurrent requests of threads and race that
            # close (a request sent on a connection being closed fails as a 503 with
            # the engine ready). A new connection over the unix socket costs
            # microseconds.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
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
        for attempt in (1, 2):
            try:
                resp = await self._client().request(method, path, **kwargs)
            except httpx.RemoteProtocolError as err:
                if attempt == 1 and _never_answered(err):
                    continue
                raise EngineUnreachable(f"{method} {path}: {type(err).__name__}: {err}") from err
            except (httpx.TransportError, httpx.StreamError) as err:
                raise EngineUnreachable(f"{method} {path}: {type(err).__name__}: {err}") from err
            break
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
        client = self._client()
        try:
            try:
                opened = client.stream("POST", path, content=data, headers=headers)
                resp = await opened.__aenter__()
            except httpx.RemoteProtocolError as err:
                if not _never_answered(err):
                    raise
                opened = client.stream("POST", path, content=data, headers=headers)
                resp = await opened.__aenter__()
            try:
                yield resp
            finally:
                await opened.__aexit__(None, None, None)
        except (httpx.TransportError, httpx.StreamError) as err:
            raise EngineUnreachable(f"POST {path}: {type(err).__name__}: {err}") from err


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
