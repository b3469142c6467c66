"""The FastAPI application of one server: middleware, error mapping, routers, OpenAPI.

Owns :func:`create_app`: the body limit (:class:`BodyLimit`: 413 for a body
over ``--max-body-bytes`` and, with a projector, the images a request may carry;
the connection closed when a body does not arrive in time), the one mapping
of errors to the OpenAI envelope
(:mod:`slmguard.serve.envelope`), the routers of :mod:`slmguard.serve.routes`
(the governor's only with a governor) and the OpenAPI document, which says
which ``model`` this server accepts and its bounds (the vocabulary's last
token id, the slot count, one slot's context, the vocabulary's size). Nothing
global: the server is ``app.state.server``.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from slmguard.errors import APIError, envelope
from slmguard.serve import routes
from slmguard.serve.schemas import CONTEXT_MARK, SLOTS_MARK, TOKEN_ID_MARK, VOCAB_MARK

if TYPE_CHECKING:
    from slmguard.serve.parts import ServerParts


def create_app(server: ServerParts) -> FastAPI:
    from slmguard import __version__
    from slmguard.serve import envelope as envelope_handlers

    app = FastAPI(
        title="slmguard",
        version=__version__,
        description="OpenAI-compatible server for small GGUF models: a guarded front to "
        "llama.cpp's llama-server.",
        docs_url=None,
        redoc_url=None,
    )
    app.state.server = server
    settings = server.settings
    envelope_handlers.install(app, retry_after_s=settings.retry_after_s)
    app.add_middleware(
        BodyLimit, limit_bytes=server.body_limit_bytes, timeout_s=settings.body_timeout_s
    )
    app.include_router(routes.openai)
    app.include_router(routes.front)
    if server.governor is not None:
        app.include_router(routes.governor)
    app.openapi = functools.partial(_openapi, app, server)  # type: ignore[method-assign]
    return app


class BodyLimit:
    """ASGI middleware: 413 for bodies over ``limit_bytes`` (declared or streamed), and
    the connection closed when the body does not arrive within ``timeout_s``."""

    def __init__(self, app: Any, limit_bytes: int, timeout_s: float = 30.0) -> None:
        self.app = app
        self.limit_bytes = limit_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from starlette.exceptions import HTTPException

        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit_bytes:
                await _send_error(send, APIError(413, self._message(), code="request_too_large"))
                return
        seen = 0
        body_done = False

        async def limited_receive() -> Any:
            nonlocal seen, body_done
            if body_done:
                return await receive()  # after the body: disconnect notices may take long
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.exceptions.TimeoutError as err:
                raise HTTPException(408, f"the request body did not arrive within "
                                    f"{self.timeout_s:.0f} s") from err  # fmt: skip
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit_bytes:
                    raise HTTPException(413, self._message())
                body_done = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body exceeds {self.limit_bytes} bytes"


async def _send_error(send: Any, err: APIError) -> None:
    env = envelope(err)
    body = json.dumps(env.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": env.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _openapi(app: FastAPI, server: ServerParts) -> dict[str, Any]:
    """/openapi.json, saying which ``model`` value this server accepts, and its bounds."""
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema is None:
        doc = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for name in (
            "ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest", "ResponsesRequest",
            "MessagesRequest", "MessageTokensRequest", "RerankRequest",
        ):  # fmt: skip
            schema = doc.get("components", {}).get("schemas", {}).get(name)
            if schema is not None:
                schema["properties"]["model"]["enum"] = list(server.models.names())
        # The largest each bound is for any served model (each request is held to its own).
        models = list(server.models)
        _document_bounds(
            doc,
            {TOKEN_ID_MARK: max(m.model.n_vocab for m in models) - 1,
             SLOTS_MARK: max(m.queue.slots for m in models),
             CONTEXT_MARK: max(m.bounds.limits.n_ctx_slot for m in models) or -1,
             VOCAB_MARK: max(m.bounds.limits.n_vocab for m in models) or -1},
        )  # fmt: skip
        app.openapi_schema = doc
    return app.openapi_schema


def _document_bounds(node: Any, maxima: dict[str, int]) -> None:
    """Replace each bound marker in /openapi.json by this server's ``maximum`` for it."""
    if isinstance(node, dict):
        for mark, maximum in maxima.items():
            if node.pop(mark, False) and maximum >= 0:
                node["maximum"] = maximum
        for value in node.values():
            _document_bounds(value, maxima)
    elif isinstance(node, list):
        for value in node:
            _document_bounds(value, maxima)
