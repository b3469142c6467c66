"""HTTP errors in the OpenAI envelope ``{"error": {message, type, param, code}}``.

Owns the exception handlers that turn every error a handler can raise into that
envelope, the server's one mapping: errors of the tree by the table in
:mod:`slmguard.errors` (:func:`~slmguard.errors.envelope`), FastAPI's validation
errors (400 naming the field; an unknown one ``unsupported_parameter``),
Starlette's HTTP errors, anything unexpected (500, logged); :func:`sse_event`,
the same envelope as a stream's last event. The Anthropic routes
(:data:`ANTHROPIC_PATHS`) answer in Anthropic's shape instead
(:func:`anthropic_body`, :func:`anthropic_sse_event`). It decides no status
itself: the error tree's table does.
"""

from __future__ import annotations

import logging
from typing import Any

from slmguard.errors import APIError, RequestError, SessionIdError, SlmguardError, envelope

log = logging.getLogger(__name__)

__all__ = ["APIError", "anthropic_sse_event", "install", "sse_event"]

#: Paths answered in Anthropic's error shape.
ANTHROPIC_PATHS = ("/v1/messages",)
#: Anthropic's error type for a status (its documented ones; else by class).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error",
}  # fmt: skip


def sse_event(err: SlmguardError) -> str:
    """``err`` as the SSE event that ends a stream."""
    import json

    return f"data: {json.dumps(envelope(err).body())}\n\n"


def anthropic_body(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI envelope's body in Anthropic's shape (the message keeps param and code)."""
    inner = body.get("error") or {}
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(inner.get("message", ""))}}


def anthropic_sse_event(err: SlmguardError) -> str:
    """``err`` as Anthropic's ``error`` event that ends a stream."""
    import json

    env = envelope(err)
    return f"event: error\ndata: {json.dumps(anthropic_body(env.status, env.body()))}\n\n"


def _validation_message(errors: list[Any]) -> tuple[str, str | None, str]:
    from slmguard.serve.schemas import error_param

    # A value that fails every member of a union yields one error per member; the
    # deepest one is the member whose shape matched (``prompt: [2, -1]`` is a list
    # with a bad item, not a bad string).
    first: dict[str, Any] = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    kind = str(first.get("type", ""))
    param = error_param(first.get("loc", ()), kind, first.get("ctx"))
    if kind == "json_invalid":
        return "the request body is not valid JSON", None, "invalid_json"
    if kind == "extra_forbidden":
        return (
            f"{param}: this field is not supported here (llama-server does not implement it, "
            "or it would bypass the server's limits); remove it",
            param,
            "unsupported_parameter",
        )
    if param == "session_id":  # the path's or the body's: one rule, one message
        return SessionIdError(first.get("input")).message, param, "invalid_session_id"
    msg = str(first.get("msg", "invalid request"))
    return (f"{param}: {msg}" if param else msg), param, "invalid_value"


def install(app: Any, *, retry_after_s: int | None = None) -> None:
    """Register the envelope handlers on a FastAPI app.

    ``retry_after_s`` is the server's default Retry-After for a 429 or 503
    that names none.
    """
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def respond(err: SlmguardError, request: Request | None = None) -> JSONResponse:
        env = envelope(err, retry_after_s=retry_after_s)
        body = env.body()
        if request is not None and request.url.path.startswith(ANTHROPIC_PATHS):
            body = anthropic_body(env.status, body)
        return JSONResponse(body, status_code=env.status, headers=env.headers())

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, SlmguardError)
        return respond(exc, request)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param, code = _validation_message(list(exc.errors()))
        return respond(APIError(400, message, param=param, code=code), request)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed",
                408: "request_timeout"}.get(status)  # fmt: skip
        if status == 400 and isinstance(exc.__cause__, ValueError | RecursionError):
            # FastAPI wraps a body it cannot decode (invalid UTF-8, nested thousands
            # deep) in a plain 400.
            detail, code = (
                "the request body is not valid UTF-8 JSON of a sane depth",
                "invalid_json",
            )
        return respond(APIError(status, detail, code=code), request)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, RecursionError):
            # json.loads of a body nested thousands deep.
            return respond(RequestError("the request body is nested too deeply",
                                        code="invalid_json"), request)  # fmt: skip
        log.exception("unhandled error", exc_info=exc)
        return respond(SlmguardError("internal server error"), request)

    app.add_exception_handler(SlmguardError, on_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
