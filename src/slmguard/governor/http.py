"""The governor's HTTP routes: ``POST /api/v1/context/trim`` and ``GET /api/v1/governor``.

Owns the two admin routes, their input validation and their authentication;
the server mounts the returned router as-is (``Hooks.routers``). Errors use the
server's OpenAI envelope (``slmguard.serve.envelope.APIError``). This module
imports the web stack at import time: only the server imports it.

Authentication: trimming needs ``Authorization: Bearer <admin token>``, a
token distinct from the API key; without an admin token configured the route
answers 403. Reading the governor's state needs the admin token or, when one
is configured, the API key (like ``/metrics``); a server with neither (loopback
only) leaves it open.

Example::

    curl -s -X POST http://127.0.0.1:8080/api/v1/context/trim \\
         -H "Authorization: Bearer $(cat /etc/slmguard/admin-token)" \\
         -H 'Content-Type: application/json' -d '{"keep_recent": 512}'
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from slmguard.errors import APIError, SessionIdError, SessionStoreError
from slmguard.governor.runtime import Governor
from slmguard.serve.sessions import SESSION_ID_RE

MAX_KEEP_RECENT = 1 << 20

Dependency = Callable[..., Awaitable[None]]  # a route dependency that only checks


class TrimRequest(BaseModel):
    """Body of ``POST /api/v1/context/trim``. Strict: ``"512"`` or ``true`` is not a count."""

    model_config = ConfigDict(extra="forbid", strict=True)

    keep_recent: int = Field(
        ge=0,
        le=MAX_KEEP_RECENT,
        description="tokens of recent conversation to keep per session "
        "(system messages are kept in addition)",
    )
    session_id: str | None = Field(
        default=None,
        pattern=f"^{SESSION_ID_RE.pattern}$",
        max_length=128,
        description="trim only this session (default: every stored session)",
    )


class TrimResponse(BaseModel):
    keep_recent: int
    session_id: str | None
    sessions_seen: int
    sessions_trimmed: int
    messages_removed: int
    tokens_removed: int
    tokens_kept: int
    prefix_cache_dropped: bool
    n_ctx: int


def _same(given: str, expected: str | None) -> bool:
    return expected is not None and hmac.compare_digest(given.encode(), expected.encode())


def build_router(governor: Governor, *, admin_token: str | None, api_key: str | None) -> APIRouter:
    """The router with both routes, bound to one governor and its tokens."""
    require_admin, require_reader = _auth(admin_token, api_key)
    errors: dict[int | str, dict[str, Any]] = {
        400: {"description": "invalid body (OpenAI error envelope)"},
        401: {"description": "missing or wrong token"},
        403: {"description": "admin routes disabled"},
        404: {"description": "no such session"},
    }
    router = APIRouter(prefix="/api/v1", tags=["governor"], responses=errors)
    _add_trim_route(router, governor, require_admin)
    _add_status_route(router, governor, require_reader)
    return router


def _auth(admin_token: str | None, api_key: str | None) -> tuple[Dependency, Dependency]:
    """The two bearer checks: the admin token (trim) and the reader's (admin token or key)."""
    bearer = HTTPBearer(auto_error=False)

    def given(creds: HTTPAuthorizationCredentials | None) -> str:
        return creds.credentials if creds is not None else ""

    async def require_admin(
        creds: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008
    ) -> None:
        if admin_token is None:
            raise APIError(
                403,
                "admin routes are disabled: start the server with --admin-token-file",
                code="admin_disabled",
            )
        if not _same(given(creds), admin_token):
            raise APIError(401, "missing or incorrect admin token", code="invalid_admin_token")

    async def require_reader(
        creds: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008
    ) -> None:
        if admin_token is None and api_key is None:
            return
        token = given(creds)
        if not (_same(token, admin_token) or _same(token, api_key)):
            raise APIError(401, "missing or incorrect token", code="invalid_api_key")

    return require_admin, require_reader


def _add_trim_route(router: APIRouter, governor: Governor, require_admin: Dependency) -> None:
    """``POST /api/v1/context/trim``: trim stored sessions, drop the cached prefix."""

    @router.post(
        "/context/trim",
        response_model=TrimResponse,
        dependencies=[Depends(require_admin)],
        summary="Trim stored conversations and drop the engine's cached prefix",
    )
    async def trim(body: TrimRequest) -> dict[str, Any]:
        if body.session_id is not None:
            _check_known_session(governor, body.session_id)
        try:
            result = await governor.trim(body.keep_recent, body.session_id)
        except SessionIdError as err:  # pattern checked above; kept as a safety net
            raise APIError(400, str(err), code="invalid_session_id", param="session_id") from err
        except SessionStoreError as err:
            raise APIError(500, str(err), code="session_store_error") from err
        return {
            "keep_recent": body.keep_recent,
            "session_id": body.session_id,
            **result,
            "n_ctx": governor.state.n_ctx,
        }


def _check_known_session(governor: Governor, session_id: str) -> None:
    """404 for a session the store does not hold (no store: the trim decides)."""
    sessions = governor.sessions
    if sessions is None:
        return
    try:
        known = session_id in sessions.sessions()
    except SessionStoreError as err:
        raise APIError(500, str(err), code="session_store_error") from err
    if not known:
        raise APIError(
            404,
            f"no stored session {session_id!r}",
            code="session_not_found",
            param="session_id",
        )


def _add_status_route(router: APIRouter, governor: Governor, require_reader: Dependency) -> None:
    """``GET /api/v1/governor``: the governor's status."""

    @router.get(
        "/governor",
        dependencies=[Depends(require_reader)],
        summary="The governor's level, memory signal and thresholds",
    )
    async def status() -> dict[str, Any]:
        return governor.status()
