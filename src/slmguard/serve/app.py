"""The FastAPI application: routes, auth, body limit, streaming.

Owns the HTTP surface (``create_app``) and nothing global: every piece of
state lives in the :class:`ServeContext` passed in, reachable from handlers as
``request.app.state.ctx``. Handlers validate, render the prompt, run the
admission hooks, wait for the engine slot, and relay the worker's events as a
JSON body or as Server-Sent Events.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from slmguard.errors import EngineError, SessionIdError, SlmguardError
from slmguard.serve.admission import EngineQueue, QueueFull
from slmguard.serve.envelope import APIError
from slmguard.serve.hooks import AdmissionInfo, AdmissionRejected, Hooks
from slmguard.serve.metrics import ServeMetrics
from slmguard.serve.procstat import read_process_memory
from slmguard.serve.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelList,
)
from slmguard.serve.supervisor import Generation, Supervisor, WorkerGone, WorkerNotReady
from slmguard.serve.templates import ChatMessage, Segment, Template, TemplateError, render_segments
from slmguard.settings import ServeSettings

log = logging.getLogger(__name__)


@dataclass
class ServeContext:
    """Everything one running server owns. The governor reaches it as ``app.state.ctx``."""

    settings: ServeSettings
    supervisor: Supervisor
    queue: EngineQueue
    model_id: str
    model_path: str
    template: Template
    api_key: str | None = None
    admin_token: str | None = None
    hooks: Hooks = field(default_factory=Hooks)
    degraded_reasons: dict[str, str] = field(default_factory=dict)
    created_s: int = field(default_factory=lambda: int(time.time()))
    metrics: ServeMetrics = field(init=False)

    def __post_init__(self) -> None:
        def worker_rss() -> float:
            pid = self.supervisor.worker_pid
            mem = read_process_memory(pid) if pid else None
            return float(mem.rss_bytes or 0) if mem else 0.0

        def front_rss() -> float:
            mem = read_process_memory("self")
            return float(mem.rss_bytes or 0) if mem else 0.0

        self.metrics = ServeMetrics(worker_rss, front_rss, lambda: float(self.queue.waiting))

    @property
    def state(self) -> str:
        state = self.supervisor.state
        if state == "ready" and self.degraded_reasons:
            return "degraded"
        return state

    async def reload_context(self, n_ctx: int) -> int:
        """Recreate the engine context with ``n_ctx`` once the running request ends."""
        await self.queue.acquire(bypass_limit=True)
        try:
            return await self.supervisor.reload(n_ctx)
        finally:
            self.queue.release()

    # The governor's EngineControl protocol (slmguard.governor.runtime).

    async def resize_context(self, n_ctx: int) -> None:
        try:
            await self.reload_context(n_ctx)
        except (WorkerGone, WorkerNotReady) as err:
            raise EngineError(f"cannot resize the context to {n_ctx} tokens: {err}") from err

    async def abort_newest(self, reason: str) -> bool:
        ids = self.supervisor.pending_ids()
        return bool(ids) and self.supervisor.abort(max(ids), reason)

    async def drop_prefix_cache(self) -> None:
        self.supervisor.drop_prefix_cache()

    def worker_pid(self) -> int | None:
        return self.supervisor.worker_pid


@dataclass(frozen=True)
class _Job:
    endpoint: str
    prompt: str | list[Segment]
    special: bool
    add_bos: bool
    params: dict[str, Any]
    stream: bool
    include_usage: bool
    info: AdmissionInfo
    # (session id, the messages this request added) for chat requests with a session
    session: tuple[str, list[dict[str, str]]] | None = None


class BodyLimit:
    """ASGI middleware: 413 for bodies over ``limit_bytes`` (declared or streamed)."""

    def __init__(self, app: Any, limit_bytes: int) -> None:
        self.app = app
        self.limit_bytes = limit_bytes

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

        async def limited_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body exceeds {self.limit_bytes} bytes"


async def _send_error(send: Any, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in (
        (400, "invalid request (OpenAI error envelope)"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "body too large"),
        (429, "queue full; see Retry-After"),
        (503, "engine loading or restarting; see Retry-After"),
    )
}


def create_app(ctx: ServeContext) -> FastAPI:
    from fastapi import APIRouter, Depends
    from fastapi.responses import JSONResponse
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

    from slmguard import __version__
    from slmguard.serve import envelope

    app = FastAPI(
        title="slmguard",
        version=__version__,
        description="OpenAI-compatible server for small GGUF models with a supervised engine.",
        docs_url=None,
        redoc_url=None,
    )
    app.state.ctx = ctx
    envelope.install(app)
    app.add_middleware(BodyLimit, limit_bytes=ctx.settings.max_body_bytes)
    bearer = HTTPBearer(auto_error=False)

    async def require_key(
        creds: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008
    ) -> None:
        if ctx.api_key is None:
            return
        given = creds.credentials if creds is not None else ""
        if not hmac.compare_digest(given.encode(), ctx.api_key.encode()):
            raise APIError(401, "missing or incorrect API key", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], responses=_ERRORS)

    @v1.get("/models", response_model=ModelList)
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": ctx.model_id, "object": "model", "created": ctx.created_s,
                      "owned_by": "slmguard"}],
        }  # fmt: skip

    @v1.post(
        "/chat/completions",
        response_model=ChatCompletion,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(ctx, body.model)
        new_msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        session = _session_id(ctx, body.session_id, request.headers.get("x-session-id"))
        msgs = new_msgs if session is None else await _session_prompt(ctx, session, new_msgs)
        messages = [ChatMessage(m["role"], m["content"]) for m in msgs]
        template = ctx.template
        if template.kind == "gguf" and not template.eos_token:
            template = replace(template, eos_token=str(ctx.supervisor.loaded.get("eos_token", "")))
        try:
            prompt = render_segments(template, messages)
        except TemplateError as err:
            raise APIError(400, str(err), code="invalid_messages", param="messages") from err
        max_tokens = body.max_completion_tokens or body.max_tokens
        job = _make_job(
            ctx, "chat", body, prompt, max_tokens, special=True, add_bos=template.add_bos,
            extra_stops=template.stop_strings, n_messages=len(messages),
        )  # fmt: skip
        if session is not None:
            job = replace(job, session=(session, new_msgs))
        return await _respond(ctx, request, job)

    @v1.post(
        "/completions",
        response_model=Completion,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(ctx, body.model)
        job = _make_job(ctx, "completions", body, body.prompt, body.max_tokens, special=False,
                        add_bos=True, extra_stops=(), n_messages=0)  # fmt: skip
        return await _respond(ctx, request, job)

    app.include_router(v1)

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        data = _health(ctx)
        ok = data["state"] in ("ready", "degraded")
        return JSONResponse(data, status_code=200 if ok else 503)

    @app.get(
        "/metrics",
        dependencies=[Depends(require_key)],
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}}, 401: _ERRORS[401]},
    )
    async def metrics() -> Response:
        body, content_type = ctx.metrics.render()
        return Response(body, media_type=content_type)

    for router in ctx.hooks.routers:
        app.include_router(router)
    _document_model_id(app, ctx.model_id)
    return app


def _document_model_id(app: FastAPI, model_id: str) -> None:
    """Say in /openapi.json which ``model`` value this server accepts."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title, version=app.version, description=app.description,
                routes=app.routes,
            )  # fmt: skip
            for name in ("ChatCompletionRequest", "CompletionRequest"):
                schema = doc.get("components", {}).get("schemas", {}).get(name)
                if schema is not None:
                    schema["properties"]["model"]["enum"] = [model_id]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _check_model(ctx: ServeContext, name: str) -> None:
    if name != ctx.model_id:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {ctx.model_id!r}",
            code="model_not_found",
            param="model",
        )


def _make_job(
    ctx: ServeContext,
    endpoint: str,
    body: ChatCompletionRequest | CompletionRequest,
    prompt: str | list[Segment],
    max_tokens: int | None,
    *,
    special: bool,
    add_bos: bool,
    extra_stops: tuple[str, ...],
    n_messages: int,
) -> _Job:
    info = AdmissionInfo(
        endpoint=endpoint,
        model=body.model,
        stream=body.stream,
        max_tokens=max_tokens,
        prompt_chars=len(prompt) if isinstance(prompt, str) else sum(len(t) for t, _ in prompt),
        n_messages=n_messages,
    )
    temperature = 1.0 if body.temperature is None else body.temperature
    params: dict[str, Any] = {
        "prompt": prompt,
        "add_bos": add_bos,
        "special": special,
        "max_tokens": max_tokens,
        "max_tokens_cap": _cap(ctx, info),
        "temperature": temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "stop": body.stop_list() + list(extra_stops),
        "seed": body.seed,
    }
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return _Job(endpoint, prompt, special, add_bos, params, body.stream, include_usage, info)


_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _session_id(ctx: ServeContext, body_sid: str | None, header_sid: str | None) -> str | None:
    """The request's session id (body field or X-Session-Id header), checked; None: none."""
    if body_sid is not None and header_sid is not None and body_sid != header_sid:
        raise APIError(400, "session_id and the X-Session-Id header differ",
                       code="invalid_session_id", param="session_id")  # fmt: skip
    sid = body_sid if body_sid is not None else header_sid
    if sid is None:
        return None
    if not _SESSION_ID.fullmatch(sid):
        raise APIError(400, f"invalid session id {sid[:140]!r}: use 1-128 characters from "
                       "A-Z a-z 0-9 . _ : -", code="invalid_session_id",
                       param="session_id")  # fmt: skip
    if ctx.hooks.sessions is None:
        raise APIError(400, "this server keeps no sessions (session_id needs the memory "
                       "governor: it runs with --no-governor)", code="sessions_unavailable",
                       param="session_id")  # fmt: skip
    return sid


async def _session_prompt(
    ctx: ServeContext, sid: str, new_msgs: list[dict[str, str]]
) -> list[dict[str, str]]:
    assert ctx.hooks.sessions is not None  # checked by _session_id
    try:
        return await ctx.hooks.sessions.session_prompt(sid, new_msgs)
    except SessionIdError as err:
        raise APIError(400, str(err), code="invalid_session_id", param="session_id") from err
    except (SlmguardError, OSError) as err:
        raise APIError(500, f"session store: {err}", code="session_store_error") from err


async def _record_turn(ctx: ServeContext, job: _Job, text: str, usage: dict[str, int]) -> None:
    """Store a finished chat turn of a session; a store failure is logged, not sent."""
    if job.session is None or ctx.hooks.sessions is None:
        return
    sid, new_msgs = job.session
    try:
        await ctx.hooks.sessions.record_turn(
            sid, new_msgs, text, prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
        )  # fmt: skip
    except (SlmguardError, OSError) as err:
        log.error("session %s: the turn was not stored: %s", sid, err)


def _cap(ctx: ServeContext, info: AdmissionInfo) -> int | None:
    caps = [c for c in (hook(info) for hook in ctx.hooks.max_tokens_caps) if c is not None]
    if ctx.settings.max_tokens_cap is not None:
        caps.append(ctx.settings.max_tokens_cap)
    return max(1, min(caps)) if caps else None


def _unavailable(ctx: ServeContext, state: str) -> APIError:
    return APIError(
        503,
        f"the engine is {state}; retry shortly",
        code=f"engine_{state}",
        retry_after_s=ctx.settings.retry_after_s,
    )


async def _admit(ctx: ServeContext, job: _Job) -> None:
    for hook in ctx.hooks.admission:
        try:
            await hook(job.info)
        except AdmissionRejected as err:
            raise APIError(
                err.status, err.message, code=err.code,
                retry_after_s=err.retry_after_s if err.retry_after_s is not None
                else (ctx.settings.retry_after_s if err.status in (429, 503) else None),
            ) from err  # fmt: skip
    if ctx.supervisor.state != "ready":
        raise _unavailable(ctx, ctx.supervisor.state)


async def _start(ctx: ServeContext, job: _Job) -> tuple[Generation, dict[str, Any]]:
    """Queue, take the engine slot and wait for the worker to admit the prompt.

    On success the caller owns the slot and must call ``_finish``.
    """
    await _admit(ctx, job)
    try:
        await ctx.queue.acquire()
    except QueueFull as err:
        raise APIError(
            429, str(err) + "; retry later", code="queue_full",
            retry_after_s=ctx.settings.retry_after_s,
        ) from err  # fmt: skip
    try:
        gen = ctx.supervisor.open_generation(job.params)
    except (WorkerNotReady, WorkerGone) as err:
        ctx.queue.release()
        raise _unavailable(ctx, ctx.supervisor.state) from err
    try:
        first = await gen.next_event()
    except WorkerGone as err:
        _finish(ctx, gen)
        raise _worker_gone(ctx, gen) from err
    except BaseException:
        _finish(ctx, gen)
        raise
    if first["op"] == "error":
        _finish(ctx, gen)
        if first.get("code") == "context_length_exceeded":
            _context_verdict(ctx, job, first)
            raise APIError(400, first["message"], code="context_length_exceeded",
                           param="messages" if job.endpoint == "chat" else "prompt")  # fmt: skip
        raise APIError(500, f"engine error: {first.get('message')}", code="engine_error")
    return gen, first


def _context_verdict(ctx: ServeContext, job: _Job, ev: dict[str, Any]) -> None:
    """Raise the governor's 503 when the prompt only misses the shrunk context."""
    if ctx.hooks.context_verdict is None or "prompt_tokens" not in ev:
        return
    limits = [t for t in (job.params["max_tokens"], job.params["max_tokens_cap"]) if t is not None]
    rejected = ctx.hooks.context_verdict(int(ev["prompt_tokens"]), min(limits) if limits else None)
    if rejected is not None:
        raise APIError(
            rejected.status, rejected.message, code=rejected.code,
            retry_after_s=rejected.retry_after_s if rejected.retry_after_s is not None
            else ctx.settings.retry_after_s,
        )  # fmt: skip


def _finish(ctx: ServeContext, gen: Generation) -> None:
    gen.close()
    ctx.queue.release()


async def _respond(ctx: ServeContext, request: Request, job: _Job) -> Response:
    arrived = time.monotonic()
    endpoint = job.endpoint
    try:
        gen, first = await _start(ctx, job)
    except APIError as err:
        ctx.metrics.requests.labels(endpoint, _outcome(err.status)).inc()
        raise
    ctx.metrics.prompt_tokens.inc(first["prompt_tokens"])
    rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    if job.stream:
        return _stream(ctx, request, job, gen, first, rid, arrived)
    return await _collect(ctx, request, job, gen, first, rid, arrived)


def _outcome(status: int) -> str:
    return {429: "rejected_queue_full", 503: "unavailable", 413: "too_large"}.get(
        status, "client_error" if status < 500 else "error"
    )


class _Timing:
    def __init__(self, ctx: ServeContext, arrived: float) -> None:
        self.ctx = ctx
        self.arrived = arrived
        self.last: float | None = None

    def piece(self) -> None:
        now = time.monotonic()
        if self.last is None:
            self.ctx.metrics.ttft.observe(now - self.arrived)
        else:
            self.ctx.metrics.token_latency.observe(now - self.last)
        self.last = now


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(
    ctx: ServeContext,
    request: Request,
    job: _Job,
    gen: Generation,
    first: dict[str, Any],
    rid: str,
    arrived: float,
) -> Response:
    from fastapi.responses import JSONResponse

    timing = _Timing(ctx, arrived)
    pieces: list[str] = []

    async def run() -> dict[str, Any]:
        while True:
            ev = await gen.next_event()
            if ev["op"] == "text":
                timing.piece()
                pieces.append(ev["text"])
            elif ev["op"] in ("done", "error"):
                return ev

    watcher = asyncio.create_task(_wait_disconnect(request))
    runner = asyncio.create_task(run())
    try:
        done, _ = await asyncio.wait({watcher, runner}, return_when=asyncio.FIRST_COMPLETED)
        if runner not in done:
            runner.cancel()
            ctx.metrics.requests.labels(job.endpoint, "client_disconnected").inc()
            log.info("client went away; generation %d cancelled", gen.id)
            return JSONResponse({}, status_code=499)
        try:
            last = runner.result()
        except WorkerGone as err:
            ctx.metrics.requests.labels(job.endpoint, "worker_died").inc()
            raise _worker_gone(ctx, gen) from err
    finally:
        watcher.cancel()
        _finish(ctx, gen)
    if last["op"] == "error":
        failure = _event_error(ctx, gen, last)
        ctx.metrics.requests.labels(job.endpoint, _outcome(failure.status)).inc()
        raise failure
    usage = _usage(last)
    ctx.metrics.completion_tokens.inc(usage["completion_tokens"])
    ctx.metrics.requests.labels(job.endpoint, "ok").inc()
    text = "".join(pieces)
    await _record_turn(ctx, job, text, usage)
    created = int(time.time())
    model = ctx.model_id
    reason = last["finish_reason"]
    if job.endpoint == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": model,
            "choices": [choice], "usage": usage}  # fmt: skip
    return JSONResponse(body)


def _event_error(ctx: ServeContext, gen: Generation, ev: dict[str, Any]) -> APIError:
    """The client-facing error for a worker ``error`` event after the start."""
    if ev.get("code") == "cancelled" and gen.abort_reason is not None:
        return APIError(503, f"request aborted by the server: {gen.abort_reason}",
                        code="aborted", retry_after_s=ctx.settings.retry_after_s)  # fmt: skip
    return APIError(500, f"engine error: {ev.get('message')}", code="engine_error")


def _worker_gone(ctx: ServeContext, gen: Generation) -> APIError:
    """The client-facing error when the worker went away during a generation."""
    if gen.abort_reason is not None:
        return APIError(503, f"request aborted by the server: {gen.abort_reason}",
                        code="aborted", retry_after_s=ctx.settings.retry_after_s)  # fmt: skip
    return APIError(
        503, "the engine worker stopped during this request; retry shortly",
        code="engine_restarting", retry_after_s=ctx.settings.retry_after_s,
    )  # fmt: skip


def _usage(ev: dict[str, Any]) -> dict[str, int]:
    p, c = int(ev["prompt_tokens"]), int(ev["completion_tokens"])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _stream(
    ctx: ServeContext,
    request: Request,
    job: _Job,
    gen: Generation,
    first: dict[str, Any],
    rid: str,
    arrived: float,
) -> Response:
    from fastapi.responses import StreamingResponse

    created = int(time.time())
    chat = job.endpoint == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = json.dumps({"id": rid, "object": obj, "created": created, "model": ctx.model_id})
    head = head[:-1] + ","  # each chunk: head + choices/usage + "}"

    def chunk(text: str | None, reason: str | None, *, role: bool = False) -> str:
        if chat:
            delta: dict[str, str] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason}
        return f'data: {head}"choices":[{json.dumps(choice, ensure_ascii=False)}]}}\n\n'

    async def events() -> AsyncIterator[str]:
        timing = _Timing(ctx, arrived)
        outcome = "client_disconnected"
        pieces: list[str] = []
        try:
            if chat:
                yield chunk(None, None, role=True)
            while True:
                try:
                    ev = await gen.next_event()
                except WorkerGone:
                    outcome = "worker_died"
                    err = _worker_gone(ctx, gen)
                    yield f"data: {json.dumps(err.body())}\n\n"
                    return
                op = ev["op"]
                if op == "text":
                    timing.piece()
                    pieces.append(ev["text"])
                    yield chunk(ev["text"], None)
                elif op == "done":
                    usage = _usage(ev)
                    ctx.metrics.completion_tokens.inc(usage["completion_tokens"])
                    await _record_turn(ctx, job, "".join(pieces), usage)
                    yield chunk(None if chat else "", ev["finish_reason"])
                    if job.include_usage:
                        yield f'data: {head}"choices":[],"usage":{json.dumps(usage)}}}\n\n'
                    yield "data: [DONE]\n\n"
                    outcome = "ok"
                    return
                elif op == "error":
                    err = _event_error(ctx, gen, ev)
                    outcome = _outcome(err.status)
                    yield f"data: {json.dumps(err.body())}\n\n"
                    return
        finally:
            _finish(ctx, gen)
            ctx.metrics.requests.labels(job.endpoint, outcome).inc()

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _health(ctx: ServeContext) -> dict[str, Any]:
    pid = ctx.supervisor.worker_pid
    worker = read_process_memory(pid) if pid else None
    front = read_process_memory(os.getpid())
    extra: dict[str, Any] = {}
    for contributor in ctx.hooks.health:
        extra.update(contributor())
    return {
        "state": ctx.state,
        "model": ctx.model_id,
        "model_path": ctx.model_path,
        "n_ctx": ctx.supervisor.n_ctx,
        "worker_pid": pid,
        "worker_restarts": ctx.supervisor.restarts,
        "queue_depth": ctx.queue.waiting,
        "busy": ctx.queue.busy,
        "memory": {
            "worker_rss_bytes": worker.rss_bytes if worker else None,
            "worker_rss_anon_bytes": worker.rss_anon_bytes if worker else None,
            "worker_rss_file_bytes": worker.rss_file_bytes if worker else None,
            "front_rss_bytes": front.rss_bytes if front else None,
        },
        "degraded_reasons": dict(ctx.degraded_reasons),
        "extra": extra,
    }
