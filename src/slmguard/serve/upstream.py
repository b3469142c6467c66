"""The front's HTTP client to its engine child, over the child's private unix socket.

Owns how the front talks to llama-server: the per-start API key, JSON bodies,
time limits, sending once more a request the engine closed unanswered, and the
translation of wire failures (:mod:`slmguard.serve.http1`) into
:class:`~slmguard.errors.EngineUnreachableError` (the engine died, was
restarted, or does not answer), so callers see one error of the tree. Each
request is its own connection.

Example::

    client = EngineClient(Path("/run/slmguard/engine.sock"))
    await client.reset(api_key)
    status, body = await client.post_json("/tokenize", {"content": "Hi"})
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from slmguard.errors import EngineUnreachableError
from slmguard.serve import http1

log = logging.getLogger(__name__)

# The largest answer read whole (the engine's /slots or /metrics are kilobytes).
MAX_ANSWER_BYTES = 64 * 1024 * 1024


class EngineClient:
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._key: str | None = None

    async def reset(self, api_key: str) -> None:
        """Use ``api_key`` from now on (a new engine start)."""
        self._key = api_key

    async def aclose(self) -> None:
        self._key = None

    def headers(self, auth: bool = True) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._key}"} if auth and self._key else {}

    async def _open(self, method: str, path: str, body: Any, auth: bool) -> http1.Answer:
        """A new connection per request, never a kept-alive one: llama-server's HTTP
        library gives each open connection one of its few HTTP threads and closes one
        idle for 5 s, so a pool would both starve concurrent requests of threads and
        race that close. A connection over the unix socket costs microseconds."""
        if self._key is None:
            raise EngineUnreachableError("the engine has not been started")
        headers = self.headers(auth)
        data = b""
        if body is not None:
            data = json.dumps(body, ensure_ascii=False).encode("utf-8")
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):
            try:
                return await http1.exchange(self.socket_path, method, path, headers, data)
            except http1.WireError as err:
                if attempt == 1 and not err.answered:
                    # Not taken (llama-server now and then closes a new connection so,
                    # as a generation on another connection ends): safe to send again.
                    # No connection at all is what a starting engine gives (its socket
                    # is not there yet): expected, so below INFO.
                    log.log(
                        logging.INFO if err.connected else logging.DEBUG,
                        "the engine did not answer (%s); sending the request again",
                        err,
                    )
                    continue
                raise _unreachable(method, path, err) from err
        raise AssertionError("unreachable")  # pragma: no cover

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout_s: float | None = None,
        auth: bool = True,
    ) -> tuple[int, bytes, str]:
        """One request; returns (status, body bytes, content type).

        No time limit by default: a long prefill on a slow board is not an error
        here (the liveness check decides what a stall is).
        """

        async def exchange() -> tuple[int, bytes, str]:
            answer = await self._open(method, path, body, auth)
            try:
                raw = await answer.read_all(MAX_ANSWER_BYTES)
            finally:
                answer.close()
            return answer.status, raw, answer.headers.get("content-type", "")

        try:
            return await asyncio.wait_for(exchange(), timeout_s)
        except asyncio.exceptions.TimeoutError as err:
            raise EngineUnreachableError(f"{method} {path}: no answer in {timeout_s} s") from err
        except http1.WireError as err:
            raise _unreachable(method, path, err) from err

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
        answer = await self._open("POST", path, body, True)
        try:
            yield EngineStream(answer, path)
        finally:
            answer.close()


class EngineStream:
    """A streamed answer of the engine: its status, then its body whole or by lines."""

    def __init__(self, answer: http1.Answer, path: str) -> None:
        self._answer = answer
        self._path = path
        self.status_code = answer.status

    async def aread(self) -> bytes:
        try:
            return await self._answer.read_all(MAX_ANSWER_BYTES)
        except http1.WireError as err:
            raise _unreachable("POST", self._path, err) from err

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's lines without their ends (SSE lines end in LF, maybe CR LF)."""
        pending = b""
        try:
            async for chunk in self._answer.chunks():
                pending += chunk
                if len(pending) > MAX_ANSWER_BYTES:
                    raise http1.WireError("an answer line is too long", answered=True)
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.removesuffix(b"\r").decode("utf-8", errors="replace")
        except http1.WireError as err:
            raise _unreachable("POST", self._path, err) from err
        if pending:
            yield pending.removesuffix(b"\r").decode("utf-8", errors="replace")


def _unreachable(method: str, path: str, err: Exception) -> EngineUnreachableError:
    return EngineUnreachableError(f"{method} {path}: {err}")


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        return None
