"""HTTP errors in the OpenAI envelope ``{"error": {message, type, param, code}}``.

Owns :class:`APIError` (raised by handlers) and the exception handlers that
turn it, FastAPI's validation errors, Starlette's HTTP errors and anything
unexpected into that envelope, so every error a client sees has one shape.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.error_type = error_type or _TYPES.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        h = {}
        if self.retry_after_s is not None:
            h["Retry-After"] = str(self.retry_after_s)
        if self.status == 401:
            h["WWW-Authenticate"] = "Bearer"
        return h


def _validation_message(errors: list[Any]) -> tuple[str, str | None, str]:
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        return "the request body is not valid JSON", None, "invalid_json"
    if kind == "extra_forbidden":
        return (
            f"{param}: this field is not supported here (llama-server does not implement it, "
            "or it would bypass the server's limits); remove it",
            param,
            "unsupported_parameter",
        )
    msg = str(first.get("msg", "invalid request"))
    return (f"{param}: {msg}" if param else msg), param, "invalid_value"


def install(app: Any) -> None:
    """Register the envelope handlers on a FastAPI app."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def respond(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers())

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return respond(exc)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param, code = _validation_message(list(exc.errors()))
        return respond(APIError(400, message, param=param, code=code))

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
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
        return respond(APIError(status, detail, code=code))

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, RecursionError):
            # json.loads of a body nested thousands deep.
            return respond(APIError(400, "the request body is nested too deeply",
                                    code="invalid_json"))  # fmt: skip
        log.exception("unhandled error", exc_info=exc)
        return respond(APIError(500, "internal server error", code="internal_error"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
