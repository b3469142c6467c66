"""The FastAPI application: routes, auth, body limit, OpenAPI document.

Owns the HTTP surface (:func:`create_app`) and nothing global: every piece of
state lives in the :class:`~slmguard.serve.context.ServeContext` passed in,
reachable from handlers as ``request.app.state.ctx``. Handlers validate
(:mod:`slmguard.serve.schemas`), then hand generations to
:mod:`slmguard.serve.relay`; the other routes are small:

- ``GET /v1/models``, ``GET /v1/models/{id}``: the served model, with its path,
  sha256 and, for the embedded base model, the note that it is not a chat model;
- ``POST /v1/embeddings``: relayed when the model is an embedding model (its
  GGUF declares a pooling type), else 400 ``embeddings_unsupported``;
- ``POST /tokenize``, ``POST /detokenize``: the engine's tokenizer;
- ``DELETE /v1/sessions/{id}``: forget a stored conversation (its owner: the
  id, and the API key when one is set);
- ``GET /health``: state, model, engine (version, pid, restarts, stalls,
  slots), queue, memory; 200 while serving, 503 otherwise;
- ``GET /metrics``: Prometheus text, the engine's ``llamacpp:*`` included;
- ``GET /slots``, ``GET /props``, ``GET /engine/metrics``: llama-server's own
  views, with the admin token only.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Path, Request
from fastapi.responses import Response

from slmguard.errors import APIError, SessionIdError, SlmguardError, envelope
from slmguard.host.process import read_status
from slmguard.host.procfs import ROOT
from slmguard.serve import relay
from slmguard.serve.context import ServeContext
from slmguard.serve.schemas import (
    SESSION_ID_PATTERN,
    SLOTS_MARK,
    TOKEN_ID_MARK,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from slmguard.serve.sessions import check_session_id
from slmguard.serve.upstream import EngineUnreachable

log = logging.getLogger(__name__)

Dependency = Callable[..., Awaitable[None]]  # a route dependency that only checks


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
    import json

    env = envelope(err)
    body = json.dumps(env.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": env.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in (
        (400, "invalid request, or a field llama-server does not implement (OpenAI envelope)"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "body too large"),
        (429, "queue full; see Retry-After"),
        (503, "engine loading, restarting, stalled or parked; see Retry-After"),
    )
}


_ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "missing or wrong admin token"},
    403: {"model": ErrorResponse, "description": "engine views disabled (no --admin-token-file)"},
    503: _ERRORS[503],
}


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def create_app(ctx: ServeContext) -> FastAPI:
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
    app.state.ctx = ctx
    envelope_handlers.install(app, retry_after_s=ctx.settings.retry_after_s)
    app.add_middleware(
        BodyLimit, limit_bytes=ctx.settings.max_body_bytes, timeout_s=ctx.settings.body_timeout_s
    )
    require_key, require_admin = _auth(ctx)
    app.include_router(_openai_router(ctx, require_key))
    keyed = [Depends(require_key)]
    _add_tokenizer_routes(app, ctx, keyed)
    _add_health_routes(app, ctx, keyed)
    _add_engine_views(app, ctx, [Depends(require_admin)])
    for router in ctx.hooks.routers:
        app.include_router(router)
    _document_model_id(app, ctx)
    return app


def _auth(ctx: ServeContext) -> tuple[Dependency, Dependency]:
    """The two bearer checks: the API key (clients) and the admin token (engine views)."""
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

    bearer = HTTPBearer(auto_error=False)

    async def require_key(
        creds: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008
    ) -> None:
        if ctx.api_key is None:
            return
        given = creds.credentials if creds is not None else ""
        if not _same(given, ctx.api_key):
            raise APIError(401, "missing or incorrect API key", code="invalid_api_key")

    async def require_admin(
        creds: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008
    ) -> None:
        if ctx.admin_token is None:
            raise APIError(403, "engine views are disabled: start the server with "
                           "--admin-token-file", code="admin_disabled")  # fmt: skip
        given = creds.credentials if creds is not None else ""
        if not _same(given, ctx.admin_token):
            raise APIError(401, "missing or incorrect admin token", code="invalid_admin_token")

    return require_key, require_admin


def _openai_router(ctx: ServeContext, require_key: Dependency) -> APIRouter:
    """``/v1``: the OpenAI routes, behind the API key."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], responses=_ERRORS)
    _add_model_routes(v1, ctx)
    _add_generation_routes(v1, ctx)
    _add_embeddings_route(v1, ctx)
    _add_session_routes(v1, ctx)
    return v1


def _add_model_routes(v1: APIRouter, ctx: ServeContext) -> None:
    """``GET /v1/models`` and ``GET /v1/models/{id}``: the one served model's card."""

    def card() -> dict[str, Any]:
        m = ctx.model
        return {
            "id": m.id, "object": "model", "created": ctx.created_s, "owned_by": "slmguard",
            "slmguard": {"path": m.path, "sha256": m.sha256, "file_bytes": m.file_bytes,
                         "n_ctx_slot": ctx.engine.config.n_ctx_slot,
                         "slots": ctx.engine.config.n_parallel, "note": m.note},
        }  # fmt: skip

    @v1.get("/models", response_model=ModelList)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @v1.get("/models/{model_id}", response_model=ModelCard)
    async def get_model(model_id: str) -> dict[str, Any]:
        _check_model(ctx, model_id)
        return card()


def _add_generation_routes(v1: APIRouter, ctx: ServeContext) -> None:
    """``POST /v1/chat/completions`` and ``POST /v1/completions``, relayed to the engine."""

    @v1.post(
        "/chat/completions",
        response_model=ChatCompletion,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(ctx, body.model)
        data = _as_sent(body)
        # A null field of a message is an absent one (llama-server refuses "name": null).
        data["messages"] = [{k: v for k, v in m.items() if v is not None} for m in data["messages"]]
        session = _session_id(body.session_id, request.headers.get("x-session-id"))
        gen = await relay.prepare_chat(ctx, data, session)
        return await relay.run(ctx, request, gen)

    @v1.post(
        "/completions",
        response_model=Completion,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(ctx, body.model)
        if isinstance(body.prompt, list):
            _check_token_ids(ctx, body.prompt, "prompt")
        data = _as_sent(body)
        if "max_tokens" not in data:
            data["max_tokens"] = body.max_tokens  # OpenAI's default of 16
        gen = await relay.prepare_completion(ctx, data)
        return await relay.run(ctx, request, gen)


def _add_embeddings_route(v1: APIRouter, ctx: ServeContext) -> None:
    """``POST /v1/embeddings``: relayed when the model is an embedding model, else 404."""

    @v1.post(
        "/embeddings",
        responses={
            404: {
                "model": ErrorResponse,
                "description": "unknown model, or the "
                "model is not an embedding model (code embeddings_unsupported)",
            }
        },
    )
    async def embeddings(body: EmbeddingRequest) -> Response:
        _check_model(ctx, body.model)
        if not ctx.model.embeddings:
            # No embedding model is served here: like an unknown model, with its reason.
            raise APIError(
                404, f"{ctx.model_id} is not an embedding model (its GGUF declares no pooling "
                "type); serve an embedding GGUF for /v1/embeddings",
                code="embeddings_unsupported", param="model",
            )  # fmt: skip
        if isinstance(body.input, list):
            for item in body.input:
                if isinstance(item, list):
                    _check_token_ids(ctx, item, "input")
                elif isinstance(item, int):
                    _check_token_ids(ctx, body.input, "input")  # type: ignore[arg-type]
                    break
        if ctx.engine.state != "ready":
            raise relay.unavailable(ctx)
        return await _relay_json(ctx, "/v1/embeddings", _as_sent(body))


def _add_session_routes(v1: APIRouter, ctx: ServeContext) -> None:
    """``DELETE /v1/sessions/{id}``: forget a stored conversation."""

    @v1.delete("/sessions/{session_id}")
    async def delete_session(
        session_id: Annotated[str, Path(pattern=SESSION_ID_PATTERN)],
    ) -> dict[str, Any]:
        try:
            check_session_id(session_id)
        except SessionIdError as err:
            raise APIError(400, str(err), code="invalid_session_id", param="session_id") from err
        if ctx.sessions is None:
            raise APIError(400, "this server keeps no sessions", code="sessions_unavailable")
        try:
            removed = await ctx.sessions.delete(session_id)
        except (SlmguardError, OSError) as err:
            raise APIError(500, f"session store: {err}", code="session_store_error") from err
        if not removed:
            raise APIError(404, f"no stored session {session_id!r}", code="session_not_found",
                           param="session_id")  # fmt: skip
        return {"id": session_id, "object": "session.deleted", "deleted": True,
                "messages_removed": removed}  # fmt: skip


def _add_tokenizer_routes(app: FastAPI, ctx: ServeContext, keyed: list[Any]) -> None:
    """``POST /tokenize`` and ``POST /detokenize``: the engine's tokenizer, behind the key."""

    @app.post("/tokenize", dependencies=keyed, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> Response:
        return await _relay_json(ctx, "/tokenize", _as_sent(body))

    @app.post("/detokenize", dependencies=keyed, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> Response:
        _check_token_ids(ctx, body.tokens, "tokens")
        return await _relay_json(ctx, "/detokenize", _as_sent(body))


def _add_health_routes(app: FastAPI, ctx: ServeContext, keyed: list[Any]) -> None:
    """``GET /health`` (open) and ``GET /metrics`` (behind the key)."""
    from fastapi.responses import JSONResponse

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        data = health_body(ctx)
        ok = data["state"] in ("ready", "degraded")
        return JSONResponse(data, status_code=200 if ok else 503)

    @app.get(
        "/metrics",
        dependencies=keyed,
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}}, 401: _ERRORS[401]},
    )
    async def metrics() -> Response:
        await ctx.metrics.fetch_engine()
        if ctx.engine.state == "ready":
            await ctx.slots.refresh(timeout_s=1.0)
        body, content_type = ctx.metrics.render()
        return Response(body, media_type=content_type)


def _add_engine_views(app: FastAPI, ctx: ServeContext, admin: list[Any]) -> None:
    """``GET /slots``, ``/props``, ``/engine/metrics``: llama-server's views (admin token)."""
    for path, upstream in (("/slots", "/slots"), ("/props", "/props"),
                           ("/engine/metrics", "/metrics")):  # fmt: skip
        app.add_api_route(
            path, _engine_view(ctx, upstream), methods=["GET"], dependencies=admin,
            summary=f"llama-server's GET {upstream} (admin token)",
            responses=_ADMIN_ERRORS,
        )  # fmt: skip


def _engine_view(ctx: ServeContext, path: str) -> Any:
    async def view() -> Response:
        if ctx.engine.state not in ("ready",):
            raise relay.unavailable(ctx)
        try:
            status, raw, ctype = await ctx.engine.client.request("GET", path, timeout_s=10.0)
        except EngineUnreachable as err:
            raise relay.unavailable(ctx, err) from err
        return Response(raw, status_code=status, media_type=ctype or "application/json")

    return view


async def _relay_json(ctx: ServeContext, path: str, body: dict[str, Any]) -> Response:
    status, raw, _ = await relay.watched_call(ctx, "POST", path, body)
    if status != 200:
        raise relay.engine_refusal(status, relay._loads(raw))
    return Response(raw, media_type="application/json")


def _as_sent(body: Any) -> dict[str, Any]:
    """The request as the client sent it (set fields only, wire names)."""
    data: dict[str, Any] = body.model_dump(exclude_unset=True, by_alias=True, mode="json")
    return data


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


def _document_model_id(app: FastAPI, ctx: ServeContext) -> None:
    """Say in /openapi.json which ``model`` value this server accepts, and its bounds."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title, version=app.version, description=app.description,
                routes=app.routes,
            )  # fmt: skip
            for name in ("ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest"):
                schema = doc.get("components", {}).get("schemas", {}).get(name)
                if schema is not None:
                    schema["properties"]["model"]["enum"] = [ctx.model_id]
            _document_bounds(
                doc, {TOKEN_ID_MARK: ctx.model.n_vocab - 1, SLOTS_MARK: ctx.queue.slots}
            )
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _check_token_ids(ctx: ServeContext, ids: list[int], param: str) -> None:
    """Token ids must name tokens of the model (the engine would index past its vocabulary)."""
    n_vocab = ctx.model.n_vocab
    if n_vocab <= 0:
        return
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside this model's vocabulary (0..{n_vocab - 1})",
                       code="invalid_value", param=param)  # fmt: skip


def _check_model(ctx: ServeContext, name: str) -> None:
    if name != ctx.model_id:
        raise APIError(
            404,
            f"model {name!r} is not served here; this server serves {ctx.model_id!r}",
            code="model_not_found",
            param="model",
        )


def _session_id(body_sid: str | None, header_sid: str | None) -> str | None:
    """The request's session id (body field or X-Session-Id header), checked; None: none."""
    if body_sid is not None and header_sid is not None and body_sid != header_sid:
        raise APIError(400, "session_id and the X-Session-Id header differ",
                       code="invalid_session_id", param="session_id")  # fmt: skip
    sid = body_sid if body_sid is not None else header_sid
    if sid is None:
        return None
    try:
        return check_session_id(sid)
    except SessionIdError as err:
        raise APIError(400, f"invalid session id {sid[:140]!r}: use 1-128 characters from "
                       "A-Z a-z 0-9 . _ : -", code="invalid_session_id",
                       param="session_id") from err  # fmt: skip


def health_body(ctx: ServeContext) -> dict[str, Any]:
    eng = ctx.engine
    pid = eng.pid
    engine_mem = read_status(ROOT, pid) if pid else None
    front = read_status(ROOT, os.getpid())
    extra: dict[str, Any] = {}
    for contributor in ctx.hooks.health:
        extra.update(contributor())
    cfg = eng.config
    return {
        "state": ctx.state,
        "model": ctx.model_id,
        "model_path": ctx.model.path,
        "model_sha256": ctx.model.sha256,
        "model_note": ctx.model.note,
        "engine": {
            "version": ctx.engine_version,
            "binary": str(eng.binary),
            "pid": pid,
            "state": eng.state,
            "restarts": eng.restarts,
            "stalls": eng.stalls,
            # Moves while the engine makes progress: streamed events and answers of
            # its decode loop (``slmguard watch`` judges stalls from outside by it).
            "progress": ctx.flights.events + (ctx.liveness.progress if ctx.liveness else 0),
            "n_ctx": cfg.n_ctx,
            "n_parallel": cfg.n_parallel,
            "n_ctx_slot": cfg.n_ctx_slot,
            "kv_unified": cfg.kv_unified,
            "flash_attn": cfg.flash_attn,
        },
        "liveness": ctx.liveness.status() if ctx.liveness is not None else None,
        "n_ctx": cfg.n_ctx_slot,
        "slots": [s.as_dict() for s in ctx.slots.current()],
        "queue_depth": ctx.queue.waiting,
        "busy": ctx.queue.busy,
        "in_flight": len(ctx.flights),
        "memory": {
            "engine_rss_bytes": engine_mem.rss_bytes if engine_mem else None,
            "engine_rss_anon_bytes": engine_mem.rss_anon_bytes if engine_mem else None,
            "engine_rss_file_bytes": engine_mem.rss_file_bytes if engine_mem else None,
            "front_rss_bytes": front.rss_bytes if front else None,
        },
        "degraded_reasons": dict(ctx.degraded_reasons),
        "extra": extra,
    }
