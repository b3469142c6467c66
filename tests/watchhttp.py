"""A tiny recording HTTP server on 127.0.0.1 for the watch tests (stdlib, one thread).

It stands in for a webhook receiver and, until the governor's real
``POST /api/v1/context/trim`` exists in the server, for the slmguard server's
``/health``, ``/api/v1/governor`` and trim routes. Every request is recorded
(method, path, headers, JSON body); answers come from ``routes``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from waiting import scaled


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Recorder:
    routes: dict[tuple[str, str], tuple[int, Any]] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    url: str = ""

    def calls(self, method: str, path: str) -> list[Recorded]:
        return [r for r in self.requests if r.method == method and r.path == path]


@contextmanager
def recording_server(routes: dict[tuple[str, str], tuple[int, Any]]) -> Iterator[Recorder]:
    rec = Recorder(routes=dict(routes))

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode("utf-8", "replace")
            rec.requests.append(
                Recorded(
                    self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body
                )
            )
            status, payload = rec.routes.get(
                (self.command, self.path), (404, {"error": "no route"})
            )
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = _answer
        do_POST = _answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    rec.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield rec
    finally:
        server.shutdown()
        server.server_close()
        thread.join(scaled(5))
