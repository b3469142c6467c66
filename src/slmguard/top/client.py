"""The server's side of ``slmguard top``: four HTTP calls, answers kept as they came.

Owns talking to a running ``slmguard serve``:

    GET  /health              no auth; 200 ready/degraded, 503 otherwise (still JSON)
    GET  /metrics             the API key as Bearer when the server has one
    GET  /api/v1/governor     the admin token (or the API key) as Bearer
    POST /api/v1/context/trim {"keep_recent": N} with the admin token (the ``t`` key)

Every call returns a :class:`Fetch` (status, parsed body, or the error) and
never raises for network or HTTP errors: an unreachable server is something
to show, not a crash. The transport is :mod:`slmguard.watch.http` (stdlib
sockets; no urllib, no ssl for ``http://``), so top stays as light as the
watcher. Interpreting the bodies is :mod:`slmguard.top.server`'s.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from slmguard.watch import client as http


@dataclass(frozen=True)
class Fetch:
    """One request's outcome. ``status`` None: no HTTP answer at all (``error`` says why)."""

    url: str
    status: int | None
    body: Any = None  # parsed JSON, or text for /metrics and non-JSON answers
    error: str | None = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def answered(self) -> bool:
        return self.status is not None

    def problem(self) -> str | None:
        """One line saying what went wrong, None when it is a 2xx."""
        if self.status is None:
            return self.error or "no answer"
        if self.ok:
            return None
        message = None
        if isinstance(self.body, dict):
            err = self.body.get("error")
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                message = err["message"]
        return f"HTTP {self.status}" + (f": {message[:120]}" if message else "")


@dataclass
class ServerClient:
    """The four calls against one server. Tokens may be None (then no Authorization)."""

    url: str
    api_key: str | None = None
    admin_token: str | None = None
    timeout_s: float = 2.0

    def _call(
        self,
        path: str,
        *,
        method: str = "GET",
        payload: Any = None,
        token: str | None = None,
        as_json: bool = True,
        timeout_s: float | None = None,
    ) -> Fetch:
        url = self.url.rstrip("/") + path
        start = time.monotonic()
        try:
            status, raw = http.request(
                url,
                method=method,
                payload=payload,
                token=token,
                timeout_s=timeout_s or self.timeout_s,
            )
        except (OSError, ValueError) as err:
            return Fetch(
                url, None, error=str(err) or type(err).__name__, elapsed_s=time.monotonic() - start
            )
        elapsed = time.monotonic() - start
        text = raw.decode("utf-8", errors="replace")
        body: Any = text
        if as_json or text[:1] in ("{", "["):
            try:
                body = json.loads(text) if text else None
            except ValueError:
                body = text[:4000]
        return Fetch(url, status, body=body, elapsed_s=elapsed)

    def health(self) -> Fetch:
        return self._call("/health")

    def metrics(self) -> Fetch:
        return self._call("/metrics", token=self.api_key, as_json=False)

    def governor(self) -> Fetch:
        return self._call("/api/v1/governor", token=self.admin_token or self.api_key)

    def trim(self, keep_recent: int) -> Fetch:
        return self._call(
            "/api/v1/context/trim",
            method="POST",
            payload={"keep_recent": keep_recent},
            token=self.admin_token,
            timeout_s=max(self.timeout_s, 30.0),  # the server drops its prompt cache first
        )
