"""The HTTP routes, as module-level routers: what each path checks, then hands over.

Owns the routes and nothing else: :data:`openai` (``/v1``, behind the API key:
models, the generation routes, ``count_tokens``, rerank, embeddings, sessions),
:data:`front` (tokenizer, ``/health``, ``/metrics``, llama-server's own views
behind the admin token) and :data:`governor` (``/api/v1``, mounted with the
memory governor). Each validates its body (:mod:`slmguard.serve.schemas`),
checks what only a route can (the model it names, token ids, a session id) and
hands the rest to the server's parts, reached through what the app holds
(:func:`server`: ``request.app.state.server``, a
:class:`~slmguard.serve.parts.ServerParts`; never the server's module). A
generation route takes ``dependencies=BOUNDED``, finds the engine of the model it
names (``srv.models``: 404 for an unknown one), holds it for the request
(``srv.residency.serving``: an on-demand model is loaded first), then calls its
dialect's ``prepare_*`` (:mod:`slmguard.serve.dialects`) and that engine's
``relay.run``. Errors are raised, never answered here. Each route's fields:
docs/serve.md, *HTTP API*.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse, Response

from slmguard.errors import EngineUnreachableError, NotFoundError, RequestError, SessionIdError
from slmguard.host.process import read_status
from slmguard.host.procfs import ROOT
from slmguard.serve.answers import loads
from slmguard.serve.auth import require_admin, require_key, require_reader, require_trim
from slmguard.serve.dialects.chat import prepare_chat
from slmguard.serve.dialects.completions import prepare_completion
from slmguard.serve.dialects.messages import count_messages, messages_body, prepare_messages
from slmguard.serve.dialects.rerank import prepare_rerank
from slmguard.serve.dialects.responses import prepare_responses, responses_body
from slmguard.serve.labels import LABEL_FIELDS
from slmguard.serve.modelengine import ModelEngine
from slmguard.serve.parts import ServerParts
from slmguard.serve.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ErrorResponse,
    Health,
    MessagesRequest,
    MessageTokensRequest,
    ModelCard,
    ModelList,
    RerankRequest,
    ResponsesRequest,
    ResponseTokensRequest,
    TokenizeRequest,
    TrimRequest,
    TrimResponse,
)
from slmguard.serve.sessions import SESSION_ID_PATTERN, SESSION_ID_RE


async def server(request: Request) -> ServerParts:
    """The server a request reached (a route dependency; ``async``, or FastAPI would run
    it in a worker thread: a thread hand-off per request)."""
    current: ServerParts = request.app.state.server
    return current


Current = Annotated[ServerParts, Depends(server)]


async def bounded(request: Request) -> None:
    """The request's JSON within :mod:`slmguard.serve.bounds` (400 naming the field), before
    its schema: a dependency every route with a JSON body takes (``dependencies=BOUNDED``)."""
    srv: ServerParts = request.app.state.server
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        return  # no body, or not JSON: the schema's 400 (invalid_json)
    named = srv.models.find(body.get("model")) if isinstance(body, dict) else None
    (named or srv.models.primary).bounds.check(body)


BOUNDED = [Depends(bounded)]

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in (
        (400, "invalid request, or a field llama-server does not implement (OpenAI envelope)"),
        (401, "missing or wrong API key"),
        (404, "unknown model, or a model that does not serve this route (its code says why)"),
        (413, "body too large"),
        (429, "queue full; see Retry-After"),
        (503, "engine loading, restarting, stalled or parked; see Retry-After"),
    )
}
_ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "missing or wrong admin token"},
    403: {"model": ErrorResponse, "description": "engine views disabled (no --admin-token-file)"},
    503: ERRORS[503],
}
_STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}}}}
_KEYED = [Depends(require_key)]

openai = APIRouter(prefix="/v1", dependencies=_KEYED, responses=ERRORS)
front = APIRouter()
governor = APIRouter(
    prefix="/api/v1",
    tags=["governor"],
    responses={
        400: {"description": "invalid body (OpenAI error envelope)"},
        401: {"description": "missing or wrong token"},
        403: {"description": "admin routes disabled"},
        404: {"description": "no such session"},
    },
)


# ------------------------------------------------------------------ /v1


def _card(srv: ServerParts, engine: ModelEngine, name: str) -> dict[str, Any]:
    m = engine.model
    config = engine.engine.config
    card = {
        "path": m.path,
        "sha256": m.sha256,
        "file_bytes": m.file_bytes,
        "n_ctx_slot": config.n_ctx_slot,
        "slots": config.n_parallel,
        "note": m.note,
    }
    if srv.models.several:  # a board: how each model is kept, and whether it is in memory
        r = engine.residency
        card |= {
            "model": m.id,
            "residency": r.residency,
            "priority": r.priority,
            "state": engine.state,
        }
    return {"id": name, "object": "model", "created": m.created_s, "owned_by": "slmguard",
            "slmguard": card}  # fmt: skip


@openai.get("/models", response_model=ModelList)
async def list_models(srv: Current) -> dict[str, Any]:
    cards = [_card(srv, engine, name) for engine in srv.models for name in engine.model.names]
    return {"object": "list", "data": cards}


@openai.get("/models/{model_id}", response_model=ModelCard)
async def get_model(model_id: str, srv: Current) -> dict[str, Any]:
    return _card(srv, srv.models.get(model_id), model_id)


@openai.post(
    "/chat/completions", response_model=ChatCompletion, responses=_STREAMED, dependencies=BOUNDED
)
async def chat_completions(body: ChatCompletionRequest, request: Request, srv: Current) -> Response:
    model = srv.models.get(body.model)
    _check_generative(model)
    data = _sendable(body)
    # A null field of a message is an absent one (llama-server refuses "name": null).
    data["messages"] = [{k: v for k, v in m.items() if v is not None} for m in data["messages"]]
    session = _session_id(body.session_id, _session_header(request))
    async with srv.residency.serving(model):
        gen = await prepare_chat(model.dialects, data, session)
        return await model.relay.run(request, gen)


@openai.post("/completions", response_model=Completion, responses=_STREAMED, dependencies=BOUNDED)
async def completions(body: CompletionRequest, request: Request, srv: Current) -> Response:
    _no_session(request)
    model = srv.models.get(body.model)
    _check_generative(model)
    _check_inputs(model, body.prompt, "prompt")
    data = _sendable(body)
    if "max_tokens" not in data:
        data["max_tokens"] = body.max_tokens  # OpenAI's default of 16
    async with srv.residency.serving(model):
        gen = await prepare_completion(model.dialects, data)
        return await model.relay.run(request, gen)


@openai.post("/responses", responses=_STREAMED, dependencies=BOUNDED)
async def responses(body: ResponsesRequest, request: Request, srv: Current) -> Response:
    """OpenAI's Responses API; a stream is named events that end with the body (no [DONE])."""
    _no_session(request)
    model = srv.models.get(body.model)
    _check_generative(model)
    async with srv.residency.serving(model):
        gen = await prepare_responses(model.dialects, _as_sent(body))
        return await model.relay.run(request, gen)


@openai.post("/responses/input_tokens", dependencies=BOUNDED)
async def count_response_tokens(body: ResponseTokensRequest, srv: Current) -> Response:
    """The input tokens a Responses request with this prompt is charged (no slot taken)."""
    model = srv.models.get(body.model)
    async with srv.residency.serving(model):
        if model.engine.state != "ready":
            raise model.relay.unavailable()
        data = await responses_body(model.dialects, _as_sent(body))
        return await _relay_json(model, "/v1/responses/input_tokens", data)


@openai.post("/messages", responses=_STREAMED, dependencies=BOUNDED)
async def messages(body: MessagesRequest, request: Request, srv: Current) -> Response:
    """Anthropic's Messages API (key as bearer or ``x-api-key``; Anthropic's error shape)."""
    _no_session(request)
    model = srv.models.get(body.model)
    _check_generative(model)
    async with srv.residency.serving(model):
        gen = await prepare_messages(model.dialects, _as_sent(body))
        return await model.relay.run(request, gen)


@openai.post("/messages/count_tokens", dependencies=BOUNDED)
async def count_message_tokens(
    body: MessageTokensRequest, request: Request, srv: Current
) -> Response:
    _no_session(request)
    model = srv.models.get(body.model)
    async with srv.residency.serving(model):
        if model.engine.state != "ready":
            raise model.relay.unavailable()
        data, images = await messages_body(model.dialects, _as_sent(body))
        # counted without the images (the engine would decode them), their tokens added
        return JSONResponse({"input_tokens": await count_messages(model.dialects, data, images)})


@openai.post(
    "/rerank",
    dependencies=BOUNDED,
    responses={
        404: {
            "model": ErrorResponse,
            "description": "unknown model, or the model is not a reranker "
            "(code rerank_unsupported)",
        }
    },
)
async def rerank(body: RerankRequest, request: Request, srv: Current) -> Response:
    _no_session(request)
    model = srv.models.get(body.model)
    if not model.model.rerank:
        raise _not_this_model(model, "a reranking model (its GGUF's pooling type is not rank)",
                              "/v1/rerank", "rerank_unsupported")  # fmt: skip
    async with srv.residency.serving(model):
        gen = await prepare_rerank(model.dialects, _as_sent(body))
        return await model.relay.run(request, gen)


@openai.post(
    "/embeddings",
    dependencies=BOUNDED,
    responses={
        404: {
            "model": ErrorResponse,
            "description": "unknown model, or the "
            "model is not an embedding model (code embeddings_unsupported)",
        }
    },
)
async def embeddings(body: EmbeddingRequest, request: Request, srv: Current) -> Response:
    _no_session(request)
    model = srv.models.get(body.model)
    served = model.model
    if not served.embeddings or served.rerank:
        # A reranker's engine computes one score per sequence; asked for an embedding it
        # reads n_embd floats from that one (past its end).
        why = ("a reranker: its pooling type is rank, its scores are /v1/rerank's"
               if served.rerank else "its GGUF declares no pooling type")  # fmt: skip
        raise _not_this_model(model, f"an embedding model ({why})", "/v1/embeddings",
                              "embeddings_unsupported")  # fmt: skip
    _check_inputs(model, body.input, "input")
    async with srv.residency.serving(model):
        if model.engine.state != "ready":
            raise model.relay.unavailable()
        return await _relay_json(model, "/v1/embeddings", _as_sent(body))


@openai.delete("/sessions/{session_id}")
async def delete_session(
    session_id: Annotated[str, Path(pattern=SESSION_ID_PATTERN)], srv: Current
) -> dict[str, Any]:
    if srv.sessions is None:
        raise RequestError("this server keeps no sessions (started with --no-sessions)",
                           code="sessions_unavailable", param="session_id")  # fmt: skip
    removed = await srv.sessions.delete(session_id)
    if not removed:
        raise NotFoundError(f"no stored session {session_id!r}", code="session_not_found",
                            param="session_id")  # fmt: skip
    return {"id": session_id, "object": "session.deleted", "deleted": True,
            "messages_removed": removed}  # fmt: skip


# ------------------------------------------------------------------ the tokenizer, health, views


@front.post("/tokenize", dependencies=_KEYED + BOUNDED, responses=ERRORS)
async def tokenize(body: TokenizeRequest, srv: Current) -> Response:
    return await _relay_json(srv.models.primary, "/tokenize", _as_sent(body))


@front.post("/detokenize", dependencies=_KEYED + BOUNDED, responses=ERRORS)
async def detokenize(body: DetokenizeRequest, srv: Current) -> Response:
    primary = srv.models.primary
    _check_token_ids(primary, body.tokens, "tokens")
    return await _relay_json(primary, "/detokenize", _as_sent(body))


@front.get("/health", response_model=Health, responses={503: {"model": Health}})
async def health(srv: Current) -> JSONResponse:
    data = health_body(srv)
    ok = data["state"] in ("ready", "degraded")
    return JSONResponse(data, status_code=200 if ok else 503)


@front.get(
    "/metrics",
    dependencies=_KEYED,
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}}, 401: ERRORS[401]},
)
async def metrics(srv: Current) -> Response:
    await srv.metrics.fetch_engine()
    for model in srv.models:
        if model.engine.state == "ready":
            await model.slots.refresh(timeout_s=1.0)
    body, content_type = srv.metrics.render()
    return Response(body, media_type=content_type)


#: llama-server's own views: our path -> the engine's.
ENGINE_VIEWS = {"/slots": "/slots", "/props": "/props", "/engine/metrics": "/metrics"}


async def view(request: Request, srv: Current) -> Response:
    if srv.engine.state != "ready":
        raise srv.relay.unavailable()
    path = ENGINE_VIEWS[request.url.path]
    try:
        status, raw, ctype = await srv.engine.client.request("GET", path, timeout_s=10.0)
    except EngineUnreachableError as err:
        raise srv.relay.unavailable(err) from err
    # The engine's own 429 or 503, relayed as it is, says when to ask again as ours do.
    retry = {"Retry-After": str(srv.relay.retry_after_s())} if status in (429, 503) else None
    return Response(raw, status_code=status, media_type=ctype or "application/json",
                    headers=retry)  # fmt: skip


for _path, _upstream in ENGINE_VIEWS.items():
    front.add_api_route(
        _path, view, methods=["GET"], dependencies=[Depends(require_admin)],
        summary=f"llama-server's GET {_upstream} (admin token)", responses=_ADMIN_ERRORS,
    )  # fmt: skip


# ------------------------------------------------------------------ /api/v1 (the governor)


@governor.post(
    "/context/trim",
    response_model=TrimResponse,
    dependencies=[Depends(require_trim)],
    summary="Trim stored conversations and drop the engine's cached prefix",
)
async def trim(body: TrimRequest, srv: Current) -> dict[str, Any]:
    gov = srv.governor
    assert gov is not None  # mounted with the governor only
    sid, store = body.session_id, gov.sessions
    if sid is not None and store is not None and sid not in store.sessions():
        raise NotFoundError(f"no stored session {sid!r}", code="session_not_found",
                            param="session_id")  # fmt: skip
    result = await gov.trim(body.keep_recent, body.session_id)
    return {"keep_recent": body.keep_recent, "session_id": body.session_id, **result,
            "n_ctx": gov.state.n_ctx}  # fmt: skip


@governor.get(
    "/governor",
    dependencies=[Depends(require_reader)],
    summary="The governor's level, memory signal and thresholds",
)
async def status(srv: Current) -> dict[str, Any]:
    assert srv.governor is not None
    return srv.governor.status()


# ------------------------------------------------------------------ what the routes share


async def _relay_json(model: ModelEngine, path: str, body: dict[str, Any]) -> Response:
    status_code, raw, _ = await model.relay.call("POST", path, body)
    if status_code != 200:
        raise model.relay.refused(status_code, loads(raw))
    return Response(raw, media_type="application/json")


def _as_sent(body: Any) -> dict[str, Any]:
    """The request as the client sent it (set fields only, wire names)."""
    data: dict[str, Any] = body.model_dump(exclude_unset=True, by_alias=True, mode="json")
    return data


def _sendable(body: Any) -> dict[str, Any]:
    """The request as sent, without the fields that only label it (no effect here)."""
    data = {k: v for k, v in _as_sent(body).items() if k not in LABEL_FIELDS}
    opts = data.get("stream_options")
    if isinstance(opts, dict):
        data["stream_options"] = {k: v for k, v in opts.items() if k != "include_obfuscation"}
    return data


def _check_token_ids(model: ModelEngine, ids: list[int], param: str) -> None:
    """Token ids must name tokens of the model (the engine would index past its vocabulary)."""
    n_vocab = model.model.n_vocab
    if n_vocab <= 0:
        return
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside this model's vocabulary "
                           f"(0..{n_vocab - 1})", code="invalid_value", param=param)  # fmt: skip


def _check_inputs(model: ModelEngine, value: Any, param: str) -> None:
    """The token ids of a prompt or input: a token list, or a list of token lists."""
    if not isinstance(value, list):
        return
    if value and isinstance(value[0], int):
        _check_token_ids(model, value, param)
        return
    for item in value:
        if isinstance(item, list):
            _check_token_ids(model, item, param)


def _not_this_model(model: ModelEngine, kind: str, route: str, code: str) -> NotFoundError:
    """A route the served model cannot answer: like an unknown model, with its reason."""
    return NotFoundError(f"{model.name} is not {kind}; serve such a GGUF for {route}",
                         code=code, param="model")  # fmt: skip


def _check_generative(model: ModelEngine) -> None:
    """A generation asked of an embedding model or a reranker: 404 with the reason. The
    front starts its engine with ``--embeddings`` or ``--reranking`` (llama-server's
    embedding-only modes); an encoder's engine answers a generation 500 (the context
    does not support logits computation)."""
    if model.model.embeddings:
        kind, use = ("a reranker", "/v1/rerank") if model.model.rerank else (
            "an embedding model", "/v1/embeddings")  # fmt: skip
        raise NotFoundError(
            f"{model.name} is {kind} (its GGUF declares a pooling type), not a model that "
            f"generates text; use {use}",
            code="generation_unsupported",
            param="model",
        )


def _session_header(request: Request) -> str | None:
    """The X-Session-Id header, if one was sent; two of them are refused (which one
    holds the conversation would be a guess)."""
    sent = request.headers.getlist("x-session-id")
    if len(sent) > 1:
        raise RequestError(f"{len(sent)} X-Session-Id headers; a request continues one "
                           "session", code="invalid_session_id",
                           param="X-Session-Id")  # fmt: skip
    return sent[0] if sent else None


def _no_session(request: Request) -> None:
    """A route that keeps no session refuses the X-Session-Id header (its body refuses
    ``session_id``): the client would believe its conversation is kept."""
    if "x-session-id" in request.headers:
        raise RequestError("the X-Session-Id header: sessions are kept by "
                           "/v1/chat/completions only, and this route would ignore it",
                           code="invalid_value", param="X-Session-Id")  # fmt: skip


def _session_id(body_sid: str | None, header_sid: str | None) -> str | None:
    """The request's session id (body field or X-Session-Id header), checked; None: none."""
    if body_sid is not None and header_sid is not None and body_sid != header_sid:
        raise RequestError("session_id and the X-Session-Id header differ",
                           code="invalid_session_id", param="session_id")  # fmt: skip
    sid = body_sid if body_sid is not None else header_sid
    if sid is not None and not SESSION_ID_RE.fullmatch(sid):
        raise SessionIdError(sid)
    return sid


def health_body(srv: ServerParts) -> dict[str, Any]:
    """``GET /health``: what ``slmguard watch`` and ``top`` read (keep its keys). The
    primary model's engine at the top; on a board, every model in ``models``."""
    primary = srv.models.primary
    front_mem = read_status(ROOT, os.getpid())
    body = {
        "state": srv.state,
        "model": srv.model.id,
        "model_path": srv.model.path,
        "model_sha256": srv.model.sha256,
        "model_note": srv.model.note,
        "engine": _engine_health(primary),
        "liveness": primary.liveness.status(),
        "n_ctx": primary.engine.config.n_ctx_slot,
        "slots": [s.as_dict() for s in primary.slots.current()],
        "queue_depth": primary.queue.waiting,
        "busy": primary.queue.busy,
        "in_flight": len(primary.flights),
        "memory": {
            **_engine_memory(primary),
            "front_rss_bytes": front_mem.rss_bytes if front_mem else None,
        },
        "degraded_reasons": srv.degraded_reasons(),
        "extra": {"governor": srv.governor.summary()} if srv.governor is not None else {},
    }
    if srv.models.several:
        body["models"] = [_model_health(m) for m in srv.models]
    return body


def _engine_health(model: ModelEngine) -> dict[str, Any]:
    eng = model.engine
    cfg = eng.config
    ready = eng.readiness()
    return {
        "version": eng.version,
        "binary": str(eng.binary),
        "grammar_bound": model.grammar_bound,  # it stops a grammar past its work bound
        "pid": eng.pid,
        "state": eng.state,
        "restarts": eng.restarts,
        "stalls": eng.stalls,
        # When it is expected back (docs/serve.md, Retry-After): its last load, from its
        # start to serving; the restart backoff left; what a 503 about it says now.
        "last_load_s": None if ready.last_load_s is None else round(ready.last_load_s, 3),
        "backoff_left_s": None if ready.backoff_left_s is None else round(ready.backoff_left_s, 3),
        "retry_after_s": model.relay.retry_after.seconds(ready),
        # Moves while the engine makes progress: streamed events and answers of
        # its decode loop (``slmguard watch`` judges stalls from outside by it).
        "progress": model.flights.events + model.liveness.progress,
        "n_ctx": cfg.n_ctx,
        "n_parallel": cfg.n_parallel,
        "n_ctx_slot": cfg.n_ctx_slot,
        "kv_unified": cfg.kv_unified,
        "flash_attn": cfg.flash_attn,
        # What the engine was started with (--n-gpu-layers, --device, --no-kv-offload).
        "offload": {
            "backend": cfg.backend,
            "device": cfg.device,
            "n_gpu_layers": cfg.n_gpu_layers,
            "kv_offload": cfg.kv_offload,
        },
    }


def _engine_memory(model: ModelEngine) -> dict[str, Any]:
    pid = model.engine.pid
    mem = read_status(ROOT, pid) if pid else None
    return {
        "engine_rss_bytes": mem.rss_bytes if mem else None,
        "engine_rss_anon_bytes": mem.rss_anon_bytes if mem else None,
        "engine_rss_file_bytes": mem.rss_file_bytes if mem else None,
    }


def _model_health(model: ModelEngine) -> dict[str, Any]:
    """One model of a board: its names, how it is kept, its engine, queue and memory."""
    r = model.residency
    return {
        "model": model.name,
        "aliases": list(model.model.aliases),
        "model_path": model.model.path,
        "state": model.state,
        "residency": r.residency,
        "priority": r.priority,
        "idle_unload_s": r.idle_unload_s,
        "planned_bytes": r.planned_bytes,
        "engine": _engine_health(model),
        "liveness": model.liveness.status(),
        "queue_depth": model.queue.waiting,
        "busy": model.queue.busy,
        "in_flight": len(model.flights),
        "memory": _engine_memory(model),
    }
