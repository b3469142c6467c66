"""The watcher's HTTP client: one JSON request, HTTP/1.1 over a plain socket.

Why not urllib: ``urllib.request`` pulls in ``http.client``, ``email`` and
``ssl`` (libssl/libcrypto), about 10 MiB of resident memory, a third of the
watcher's budget on a 4 GB board, to talk to a server on loopback. Plain
``http://`` URLs (the server, a LAN webhook) go through this small client;
``https://`` URLs (a remote webhook) load urllib on first use.

It sends ``Connection: close`` and reads the answer to EOF, then decodes a
``Content-Length`` or chunked body (uvicorn uses both). Network failures raise
``OSError``; a malformed answer raises ``ValueError``. HTTP error statuses are
returned, not raised.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

MAX_RESPONSE_BYTES = 1 << 20
USER_AGENT = "slmguard-watch"


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    pos = 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            raise ValueError("truncated chunked body")
        size = int(data[pos:end].split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return bytes(out)
        start = end + 2
        out += data[start : start + size]
        pos = start + size + 2


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, lower-cased headers, body) from a whole HTTP/1.x response."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError("no end of headers in the response")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP status line: {lines[0][:60]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = _dechunk(rest)
    elif headers.get("content-length", "").isdigit():
        body = rest[: int(headers["content-length"])]
    else:
        body = rest
    return int(parts[1]), headers, body


def _via_urllib(
    url: str, method: str, data: bytes | None, headers: Mapping[str, str], timeout_s: float
) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=data, method=method, headers=dict(headers))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return int(response.status), response.read(MAX_RESPONSE_BYTES)
    except urllib.error.HTTPError as err:
        body = err.read(MAX_RESPONSE_BYTES)
        err.close()
        return int(err.code), body
    except urllib.error.URLError as err:
        raise OSError(str(err.reason)) from err


def request(
    url: str,
    *,
    method: str = "GET",
    payload: Any = None,
    body: bytes | None = None,
    token: str | None = None,
    timeout_s: float = 2.0,
) -> tuple[int, bytes]:
    """Send one request; returns (status, body bytes). JSON ``payload`` or raw ``body``."""
    data = body if payload is None else json.dumps(payload).encode("utf-8")
    headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    parts = urlsplit(url)
    if parts.scheme == "https":
        return _via_urllib(url, method, data, headers, timeout_s)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"unsupported URL {url!r} (http:// or https://)")
    host = parts.hostname
    port = parts.port or 80
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host_header = f"[{host}]" if ":" in host else host
    if parts.port:
        host_header += f":{parts.port}"
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host_header}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"Content-Length: {len(data or b'')}")
    raw_request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (data or b"")
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    size = 0
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(raw_request)
        while size <= MAX_RESPONSE_BYTES:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{url}: no complete answer within {timeout_s:g} s")
            sock.settimeout(remaining)
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    status, _, body_bytes = parse_response(b"".join(chunks))
    return status, body_bytes
