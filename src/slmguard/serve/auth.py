"""Who may call what: the API key, the admin token, and the one bearer check.

Owns the route dependencies built on :func:`presents`, the one constant-time
comparison of an ``Authorization: Bearer`` token with a secret, against the
server's :class:`~slmguard.settings.Tokens` (read through what the app holds,
:class:`~slmguard.serve.parts.ServerParts`): :func:`require_key` (the API key;
Anthropic's routes take it in ``x-api-key`` too), :func:`require_admin` and
:func:`require_trim` (the admin token; 403 without one), :func:`require_reader`
(either, open when neither is set). The admin token never falls back to the API
key (``slmguard.settings``). It reads no body and answers no route itself.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from slmguard.errors import APIError
from slmguard.serve.envelope import ANTHROPIC_PATHS
from slmguard.settings import Tokens

if TYPE_CHECKING:
    from slmguard.serve.parts import ServerParts

bearer = HTTPBearer(auto_error=False)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def presents(creds: HTTPAuthorizationCredentials | None, *secrets: str | None) -> bool:
    """Whether the request's bearer token is one of ``secrets`` (None ones never match)."""
    given = (creds.credentials if creds is not None else "").encode()
    return any(s is not None and hmac.compare_digest(given, s.encode()) for s in secrets)


def _tokens(request: Request) -> Tokens:
    server: ServerParts = request.app.state.server
    return server.tokens


async def require_key(request: Request, creds: Credentials) -> None:
    """The API key as a bearer token, or (Anthropic's routes) in ``x-api-key``."""
    key = _tokens(request).api_key
    if key is None or presents(creds, key):
        return
    given = request.headers.get("x-api-key")
    anthropic = request.url.path.startswith(ANTHROPIC_PATHS)
    if anthropic and given is not None and hmac.compare_digest(given.encode(), key.encode()):
        return
    raise APIError(401, "missing or incorrect API key", code="invalid_api_key")


async def require_admin(request: Request, creds: Credentials) -> None:
    _admin(creds, _tokens(request).admin_token, "engine views are disabled")


async def require_trim(request: Request, creds: Credentials) -> None:
    _admin(creds, _tokens(request).admin_token, "admin routes are disabled")


def _admin(creds: HTTPAuthorizationCredentials | None, token: str | None, disabled: str) -> None:
    """403 without an admin token configured, 401 unless the request presents it."""
    if token is None:
        raise APIError(403, f"{disabled}: start the server with --admin-token-file",
                       code="admin_disabled")  # fmt: skip
    if not presents(creds, token):
        raise APIError(401, "missing or incorrect admin token", code="invalid_admin_token")


async def require_reader(request: Request, creds: Credentials) -> None:
    tokens = _tokens(request)
    if tokens.admin_token is None and tokens.api_key is None:
        return
    if not presents(creds, tokens.admin_token, tokens.api_key):
        raise APIError(401, "missing or incorrect token", code="invalid_api_key")
