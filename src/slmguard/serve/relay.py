"""One generation through the front: prepare, admit, relay the engine's answer.

Owns what happens to a validated chat or completion request between the
route and llama-server:

1. **prepare**: a session's stored history goes in front of the new messages;
   the prompt is tokenized by the engine itself (``/apply-template`` then
   ``/tokenize`` for chat, ``/tokenize`` for completions: the exact count the
   engine will see); ``max_tokens`` is capped (the governor's cap and
   ``--max-tokens-cap``) and checked: prompt + max_tokens must fit one slot's
   context, else 400 ``context_length_exceeded`` (or the governor's 503 while
   the context is shrunk). A session whose history no longer fits loses its
   oldest turns until it does, and the response says how many
   (``slmguard.session.dropped_messages`` and ``X-Slmguard-Session-Dropped``).
2. **admit**: the governor's admission hooks, then a place in the slot queue
   (429 with Retry-After when it is full).
3. **relay**: the body goes to llama-server unchanged but for the front's
   rewrites; a stream is relayed event by event as the engine sends it (each
   event is progress for the liveness check), a JSON answer as it came. The
   client going away closes the upstream request, which makes llama-server
   stop that generation at its next token. The governor's abort cancels the
   upstream task; the client then gets 503 with the reason.

Errors use the OpenAI envelope (:class:`~slmguard.serve.envelope.APIError`);
llama-server's own refusals keep their status and message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slmguard.errors import APIError, RequestTooLargeError, SessionIdError, SlmguardError, envelope
from slmguard.serve.envelope import sse_event
from slmguard.serve.flights import Flight
from slmguard.serve.hooks import AdmissionInfo
from slmguard.serve.upstream import EngineUnreachable

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

    from slmguard.serve.context import ServeContext

log = logging.getLogger(__name__)

Message = dict[str, Any]
# Keys of a chat body /apply-template needs to build the same prompt as the completion.
_TEMPLATE_KEYS = (
    "messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
    "reasoning_effort", "response_format",
)  # fmt: skip
# When a session's history is too long and max_tokens is not given, keep room for this
# much of an answer (a quarter of the slot's context, at most 512 tokens).
_SESSION_ANSWER_MAX = 512


@dataclass
class Turn:
    """A session's part of a chat request."""

    session_id: str
    new_messages: list[Message]
    dropped_messages: int = 0


@dataclass
class Generation:
    """A prepared request, ready to be admitted and sent."""

    endpoint: str  # "chat" | "completions"
    path: str  # the engine's route
    body: dict[str, Any]
    stream: bool
    include_usage: bool  # the client asked for the usage chunk
    n: int
    info: AdmissionInfo
    turn: Turn | None = None
    arrived_s: float = field(default_factory=time.monotonic)


# ------------------------------------------------------------------ prepare


def unavailable(ctx: ServeContext, err: Exception | None = None) -> APIError:
    """503 for a request the engine cannot take now: its state, or why it did not answer."""
    state = ctx.engine.state
    if state == "ready" and err is not None:
        # Running, yet the request failed on its way: say so (and log it: it is a bug
        # or a resource limit of the engine, not a restart the client can wait out).
        log.warning("the engine did not answer (%s) although it is ready", err)
        return APIError(
            503, f"the engine did not answer ({err}); retry shortly", code="engine_unreachable",
            retry_after_s=ctx.settings.retry_after_s,
        )  # fmt: skip
    return APIError(
        503, f"the engine is {state}; retry shortly", code=f"engine_{state}",
        retry_after_s=ctx.settings.retry_after_s,
    )  # fmt: skip


def engine_refusal(status: int, data: Any) -> APIError:
    """llama-server's own error answer, in our envelope with its status and message."""
    err = data.get("error") if isinstance(data, dict) else None
    message = str(err.get("message", "")) if isinstance(err, dict) else ""
    kind = str(err.get("type", "")) if isinstance(err, dict) else ""
    if status == 503:
        return APIError(503, f"the engine is busy: {message}", code="engine_unavailable",
                        retry_after_s=2)  # fmt: skip
    if status >= 500 or status < 400:
        return APIError(500, f"engine error ({status}): {message}", code="engine_error")
    return APIError(
        status, message or f"the engine refused the request ({status})",
        code=kind or "engine_refused", error_type="invalid_request_error",
    )  # fmt: skip


async def watched_call(
    ctx: ServeContext, method: str, path: str, body: Any = None
) -> tuple[int, bytes, str]:
    """One engine request outside a generation (tokenize, apply-template), watched.

    It is pending work like a generation: registered in ``ctx.flights`` (no slot),
    so the liveness check sees a wedged engine that never answers it and aborts it
    (503 ``engine_stalled``) instead of leaving the client hanging.
    """
    flight = ctx.flights.open(path, stream=False, slots=0)
    task = asyncio.ensure_future(ctx.engine.client.request(method, path, body))
    flight.task = task
    try:
        return await task
    except asyncio.CancelledError:
        task.cancel()
        if flight.abort_reason is None:
            raise  # the client went away
        raise gone_error(ctx, flight) from None
    except EngineUnreachable as err:
        raise unavailable(ctx, err) from err
    finally:
        ctx.flights.close(flight)


async def _engine_json(ctx: ServeContext, path: str, body: Any) -> Any:
    status, raw, _ = await watched_call(ctx, "POST", path, body)
    data = _loads(raw)
    if status != 200:
        raise engine_refusal(status, data)
    return data


async def count_tokens(ctx: ServeContext, text: str) -> int:
    data = await _engine_json(
        ctx, "/tokenize", {"content": text, "add_special": True, "parse_special": True}
    )
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list):
        raise APIError(500, "the engine's /tokenize answer has no tokens", code="engine_error")
    return len(tokens)


async def refuse_control_tokens(ctx: ServeContext, messages: list[Message]) -> None:
    """400 when message text holds one of the model's control tokens.

    llama-server renders the chat template to text and tokenizes it with special
    tokens parsed, so a message holding ``<end_of_turn>`` (Gemma) or ``<|im_end|>``
    (ChatML models) would end its turn and forge the next one. Text without
    ``<`` or ``[`` (the shape of every common control token) is not checked; the
    rest is tokenized twice, with and without special parsing: a control token
    makes the counts differ.
    """
    texts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [str(p.get("text", "")) for p in content if isinstance(p, dict)]
    joined = "\n".join(t for t in texts if "<" in t or "[" in t)
    if not joined:
        return
    counts = []
    for special in (True, False):
        data = await _engine_json(
            ctx, "/tokenize", {"content": joined, "add_special": False, "parse_special": special}
        )
        tokens = data.get("tokens") if isinstance(data, dict) else None
        counts.append(len(tokens) if isinstance(tokens, list) else 0)
    if counts[0] != counts[1]:
        raise APIError(
            400,
            "a message contains text that is one of this model's control tokens (such as a "
            "turn marker); it would forge a turn of the conversation, so it is refused",
            code="control_token_in_message",
            param="messages",
        )


async def count_chat_tokens(ctx: ServeContext, body: dict[str, Any]) -> int:
    data = await _engine_json(
        ctx, "/apply-template", {k: body[k] for k in _TEMPLATE_KEYS if k in body}
    )
    prompt = data.get("prompt") if isinstance(data, dict) else None
    if not isinstance(prompt, str):
        raise APIError(
            500, "the engine's /apply-template answer has no prompt", code="engine_error"
        )
    return await count_tokens(ctx, prompt)


def max_tokens_cap(ctx: ServeContext, info: AdmissionInfo) -> int | None:
    caps = [c for c in (hook(info) for hook in ctx.hooks.max_tokens_caps) if c is not None]
    if ctx.settings.max_tokens_cap is not None:
        caps.append(ctx.settings.max_tokens_cap)
    return max(1, min(caps)) if caps else None


def _context_error(
    ctx: ServeContext, endpoint: str, prompt_tokens: int, wanted: int | None
) -> SlmguardError:
    n_ctx = ctx.engine.config.n_ctx_slot
    verdict = ctx.hooks.context_verdict
    if verdict is not None:
        rejected = verdict(prompt_tokens, wanted)
        if rejected is not None:
            return rejected
    more = wanted if wanted is not None and wanted > 0 else 0
    return RequestTooLargeError(
        f"this model's context is {n_ctx} tokens per request; the prompt has {prompt_tokens} "
        f"tokens and {more} more were requested for the completion",
        param="messages" if endpoint == "chat" else "prompt",
    )


def _fits(ctx: ServeContext, prompt_tokens: int, wanted: int) -> bool:
    return wanted > 0 and prompt_tokens + wanted <= ctx.engine.config.n_ctx_slot


async def _sized(
    ctx: ServeContext, endpoint: str, prompt_tokens: int, requested: int | None, info: AdmissionInfo
) -> int:
    """The max_tokens to send: requested (or the rest of the context), capped, checked."""
    room = ctx.engine.config.n_ctx_slot - prompt_tokens
    cap = max_tokens_cap(ctx, info)
    wanted = requested if requested is not None else room
    if cap is not None:
        wanted = min(wanted, cap)
    if prompt_tokens == 0 or not _fits(ctx, prompt_tokens, wanted):
        raise _context_error(ctx, endpoint, prompt_tokens, wanted)
    return wanted


def _check_n(ctx: ServeContext, n: int | None) -> int:
    n = n or 1
    if n > ctx.queue.slots:
        raise APIError(
            400, f"n={n}: this server runs {ctx.queue.slots} slot(s), so at most "
            f"{ctx.queue.slots} completions per request", code="invalid_value", param="n",
        )  # fmt: skip
    return n


async def prepare_chat(
    ctx: ServeContext, data: dict[str, Any], session_id: str | None
) -> Generation:
    """A chat request (already validated by its schema) made ready for the engine."""
    body = {k: v for k, v in data.items() if k not in ("session_id", "max_completion_tokens")}
    body["model"] = ctx.model_id
    requested = data.get("max_completion_tokens") or data.get("max_tokens")
    new_messages: list[Message] = list(data["messages"])
    turn = None
    if session_id is not None:
        if ctx.sessions is None:
            raise APIError(400, "this server keeps no sessions (started with --no-sessions)",
                           code="sessions_unavailable", param="session_id")  # fmt: skip
        if (data.get("n") or 1) != 1:
            raise APIError(400, "a session turn has one answer: n must be 1", param="n",
                           code="invalid_value")  # fmt: skip
        turn = Turn(session_id, new_messages)
        body["messages"] = await _session_messages(ctx, session_id, new_messages)
    n = _check_n(ctx, data.get("n"))
    await refuse_control_tokens(ctx, new_messages)
    prompt_tokens = await count_chat_tokens(ctx, body)
    if turn is not None and not _fits(ctx, prompt_tokens, _answer_room(ctx, requested)):
        prompt_tokens = await _fit_session(ctx, body, turn, prompt_tokens, requested)
    info = AdmissionInfo("chat", ctx.model_id, bool(data.get("stream")), requested,
                         prompt_tokens, len(body["messages"]))  # fmt: skip
    body["max_tokens"] = await _sized(ctx, "chat", prompt_tokens, requested, info)
    return _generation(ctx, "chat", "/v1/chat/completions", body, data, n, info, turn)


async def prepare_completion(ctx: ServeContext, data: dict[str, Any]) -> Generation:
    body = dict(data)
    body["model"] = ctx.model_id
    requested = data.get("max_tokens")
    n = _check_n(ctx, data.get("n"))
    prompt = data["prompt"]
    prompt_tokens = len(prompt) if isinstance(prompt, list) else await count_tokens(ctx, prompt)
    info = AdmissionInfo("completions", ctx.model_id, bool(data.get("stream")), requested,
                         prompt_tokens, 0)  # fmt: skip
    body["max_tokens"] = await _sized(ctx, "completions", prompt_tokens, requested, info)
    return _generation(ctx, "completions", "/v1/completions", body, data, n, info, None)


def _generation(
    ctx: ServeContext, endpoint: str, path: str, body: dict[str, Any], data: dict[str, Any],
    n: int, info: AdmissionInfo, turn: Turn | None,
) -> Generation:  # fmt: skip
    stream = bool(data.get("stream"))
    opts = data.get("stream_options") or {}
    include_usage = bool(opts.get("include_usage"))
    if stream:
        # The front needs the usage for its metrics and the session store.
        body["stream_options"] = {**opts, "include_usage": True}
    return Generation(endpoint, path, body, stream, include_usage, n, info, turn)


def _answer_room(ctx: ServeContext, requested: int | None) -> int:
    if requested is not None:
        return requested
    return min(_SESSION_ANSWER_MAX, max(1, ctx.engine.config.n_ctx_slot // 4))


async def _session_messages(
    ctx: ServeContext, session_id: str, new_messages: list[Message]
) -> list[Message]:
    assert ctx.sessions is not None
    try:
        return await ctx.sessions.session_prompt(session_id, new_messages)
    except SessionIdError as err:
        raise APIError(400, str(err), code="invalid_session_id", param="session_id") from err
    except (SlmguardError, OSError) as err:
        raise APIError(500, f"session store: {err}", code="session_store_error") from err


async def _fit_session(
    ctx: ServeContext, body: dict[str, Any], turn: Turn, prompt_tokens: int,
    requested: int | None,
) -> int:  # fmt: skip
    """Drop the session's oldest turns until prompt + answer fit one slot (and store that)."""
    messages: list[Message] = body["messages"]
    systems = [m for m in messages if m.get("role") == "system"]
    n_new = len(turn.new_messages)
    stored = [m for m in messages[: len(messages) - n_new] if m.get("role") != "system"]
    room = _answer_room(ctx, requested)
    dropped = 0
    while stored and not _fits(ctx, prompt_tokens, room):
        # Drop a whole exchange: the oldest message and what follows up to the next user turn.
        cut = 1
        while cut < len(stored) and stored[cut].get("role") != "user":
            cut += 1
        stored = stored[cut:]
        dropped += cut
        body["messages"] = [*systems, *stored, *turn.new_messages]
        prompt_tokens = await count_chat_tokens(ctx, body)
    if dropped:
        assert ctx.sessions is not None
        try:
            await ctx.sessions.drop_oldest(turn.session_id, dropped)
        except (SlmguardError, OSError) as err:
            raise APIError(500, f"session store: {err}", code="session_store_error") from err
        turn.dropped_messages = dropped
        log.info("session %s: dropped its %d oldest messages to fit the context",
                 turn.session_id, dropped)  # fmt: skip
    return prompt_tokens


# ------------------------------------------------------------------ admit


async def admit(ctx: ServeContext, gen: Generation) -> int:
    """The governor's verdict, then slots in the queue; returns the slots taken."""
    for hook in ctx.hooks.admission:
        await hook(gen.info)  # raises OverloadedError / RequestTooLargeError to refuse
    if ctx.engine.state != "ready":
        raise unavailable(ctx)
    return await ctx.queue.acquire(gen.n)  # QueueFullError: 429


# ------------------------------------------------------------------ relay


def outcome(err: SlmguardError | int) -> str:
    """The metrics outcome of a refused request (by its HTTP status)."""
    status = err if isinstance(err, int) else envelope(err).status
    return {429: "rejected_queue_full", 503: "unavailable", 413: "too_large"}.get(
        status, "client_error" if status < 500 else "error"
    )


def gone_error(ctx: ServeContext, flight: Flight) -> APIError:
    """The client-facing error when the engine stopped answering during a generation."""
    if flight.abort_reason is not None:
        code = flight.abort_code
        text = flight.abort_reason
        if code == "aborted":
            text = f"request aborted by the server: {text}"
        return APIError(503, text, code=code, retry_after_s=ctx.settings.retry_after_s)
    if ctx.engine.state == "stalled":
        return APIError(503, "the engine stopped making progress and is being restarted; "
                        "retry shortly", code="engine_stalled",
                        retry_after_s=ctx.settings.retry_after_s)  # fmt: skip
    return APIError(
        503, "the engine stopped during this request; retry shortly",
        code="engine_restarting", retry_after_s=ctx.settings.retry_after_s,
    )  # fmt: skip


async def run(ctx: ServeContext, request: Request, gen: Generation) -> Response:
    """Admit and relay one generation; every outcome is counted."""
    try:
        taken = await admit(ctx, gen)
    except SlmguardError as err:
        ctx.metrics.requests.labels(gen.endpoint, outcome(err)).inc()
        raise
    flight = ctx.flights.open(gen.endpoint, stream=gen.stream, slots=taken)
    ctx.metrics.prompt_tokens.inc(gen.info.prompt_tokens)

    def finish() -> None:
        ctx.flights.close(flight)
        ctx.queue.release(taken)

    try:
        if gen.stream:
            return await _stream(ctx, gen, flight, finish)
        return await _collect(ctx, request, gen, flight, finish)
    except BaseException:
        finish()
        raise


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _session_header(gen: Generation) -> dict[str, str]:
    if gen.turn is None or not gen.turn.dropped_messages:
        return {}
    return {"X-Slmguard-Session-Dropped": str(gen.turn.dropped_messages)}


async def _collect(
    ctx: ServeContext, request: Request, gen: Generation, flight: Flight, finish: Any
) -> Response:
    from fastapi.responses import JSONResponse, Response

    upstream = asyncio.create_task(ctx.engine.client.request("POST", gen.path, gen.body))
    flight.task = upstream
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({upstream, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if upstream not in done:
        upstream.cancel()
        ctx.metrics.requests.labels(gen.endpoint, "client_disconnected").inc()
        ctx.metrics.cancelled.labels("client").inc()
        log.info("client went away; %s generation %d cancelled", gen.endpoint, flight.id)
        finish()
        return JSONResponse({}, status_code=499)
    finish()
    if upstream.cancelled() or isinstance(upstream.exception(), EngineUnreachable):
        err = gone_error(ctx, flight)
        ctx.metrics.requests.labels(gen.endpoint, "engine_died" if flight.abort_reason is None
                                    else "aborted").inc()  # fmt: skip
        if flight.abort_reason is not None:
            ctx.metrics.cancelled.labels(flight.abort_code).inc()
        raise err
    status, raw, _ = upstream.result()
    data = _loads(raw)
    if status != 200:
        refused = _refusal(ctx, gen, status, data)
        ctx.metrics.requests.labels(gen.endpoint, outcome(refused)).inc()
        raise refused
    if not isinstance(data, dict):
        ctx.metrics.requests.labels(gen.endpoint, "error").inc()
        raise APIError(500, "the engine's answer is not JSON", code="engine_error")
    _account(ctx, gen, data)
    choices = data.get("choices") or [{}]
    message = choices[0].get("message") if isinstance(choices[0], dict) else None
    await _record(ctx, gen, message if isinstance(message, dict) else None, data.get("usage"))
    ctx.metrics.requests.labels(gen.endpoint, "ok").inc()
    headers = _session_header(gen)
    if headers:
        data["slmguard"] = {"session": {"dropped_messages": gen.turn.dropped_messages}}  # type: ignore[union-attr]
        return JSONResponse(data, headers=headers)
    return Response(raw, media_type="application/json")


def _refusal(ctx: ServeContext, gen: Generation, status: int, data: Any) -> SlmguardError:
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and err.get("type") == "exceed_context_size_error":
        n_prompt = err.get("n_prompt_tokens")
        if isinstance(n_prompt, int):
            return _context_error(ctx, gen.endpoint, n_prompt, gen.body.get("max_tokens"))
    return engine_refusal(status, data)


def _loads(raw: bytes | str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None


def _account(ctx: ServeContext, gen: Generation, data: dict[str, Any]) -> None:
    usage = data.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        ctx.metrics.completion_tokens.inc(usage["completion_tokens"])
    ctx.metrics.observe_timings(data.get("timings"))


async def _record(ctx: ServeContext, gen: Generation, answer: Message | None, usage: Any) -> None:
    """Store a finished session turn; a store failure is logged, not sent."""
    if gen.turn is None or ctx.sessions is None or answer is None:
        return
    out: Message = {"role": "assistant", "content": answer.get("content")}
    for key in ("tool_calls", "reasoning_content"):
        if answer.get(key):
            out[key] = answer[key]
    usage = usage if isinstance(usage, dict) else {}
    try:
        await ctx.sessions.record_turn(
            gen.turn.session_id, gen.turn.new_messages, out,
            prompt_tokens=int(usage.get("prompt_tokens") or gen.info.prompt_tokens),
            completion_tokens=int(usage.get("completion_tokens") or 1),
        )  # fmt: skip
    except (SlmguardError, OSError) as err:
        log.error("session %s: the turn was not stored: %s", gen.turn.session_id, err)


class _End:
    """The upstream stream ended (``error`` set when it broke)."""

    def __init__(self, error: str | None = None, aborted: bool = False) -> None:
        self.error = error
        self.aborted = aborted


async def _pump(
    ctx: ServeContext, gen: Generation, q: asyncio.Queue[tuple[int, bytes] | str | _End]
) -> None:
    """The upstream side of a stream: its status first, then each line, then an end."""
    try:
        async with ctx.engine.client.stream(gen.path, gen.body) as resp:
            if resp.status_code != 200:
                q.put_nowait((resp.status_code, await resp.aread()))
                return
            q.put_nowait((200, b""))
            async for line in resp.aiter_lines():
                if line:
                    q.put_nowait(line)
        q.put_nowait(_End())
    except EngineUnreachable as err:
        q.put_nowait(_End(error=str(err)))
    except asyncio.CancelledError:
        q.put_nowait(_End(aborted=True))
        raise


async def _stream(ctx: ServeContext, gen: Generation, flight: Flight, finish: Any) -> Response:
    from fastapi.responses import StreamingResponse

    q: asyncio.Queue[tuple[int, bytes] | str | _End] = asyncio.Queue()
    pump = asyncio.create_task(_pump(ctx, gen, q))
    flight.task = pump
    first = await q.get()
    if isinstance(first, _End):
        finish()
        ctx.metrics.requests.labels(gen.endpoint, "engine_died").inc()
        raise gone_error(ctx, flight)
    assert isinstance(first, tuple)
    status, raw = first
    if status != 200:
        finish()
        err = _refusal(ctx, gen, status, _loads(raw))
        ctx.metrics.requests.labels(gen.endpoint, outcome(err)).inc()
        raise err
    relay = _StreamRelay(ctx, gen, flight)

    async def events() -> Any:
        try:
            while True:
                item = await q.get()
                if isinstance(item, _End):
                    if not relay.done:
                        yield relay.broken()
                    return
                assert isinstance(item, str)
                out = relay.line(item)
                if relay.done and relay.usage_seen:
                    # Before the last event goes out: a client may close the stream
                    # the moment it reads [DONE], which cancels this generator.
                    await relay.finished()
                if out:
                    yield out
        finally:
            pump.cancel()
            if not relay.done and relay.outcome == "client_disconnected":
                ctx.metrics.cancelled.labels("client").inc()
            ctx.metrics.requests.labels(gen.endpoint, relay.outcome).inc()
            finish()

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **_session_header(gen)},
    )


class _StreamRelay:
    """Relays one SSE stream line by line and keeps what the front needs from it."""

    def __init__(self, ctx: ServeContext, gen: Generation, flight: Flight) -> None:
        self.ctx = ctx
        self.gen = gen
        self.flight = flight
        self.done = False
        self.usage_seen = False
        self.recorded = False
        self.outcome = "client_disconnected"
        self.last_s: float | None = None
        self.turn = _TurnBuilder() if gen.turn is not None else None
        self.usage: Any = None

    def line(self, line: str) -> str | None:
        if line.startswith(":"):
            return line + "\n\n"  # the engine's keep-alive comment: pass it on
        if not line.startswith("data: "):
            return None
        payload = line[6:]
        if payload == "[DONE]":
            self.done = True
            self.outcome = "ok"
            return "data: [DONE]\n\n"
        now = time.monotonic()
        self.ctx.flights.progressed(self.flight, now)
        metrics = self.ctx.metrics
        if self.last_s is None:
            metrics.ttft.observe(now - self.gen.arrived_s)
        else:
            metrics.token_latency.observe(now - self.last_s)
        self.last_s = now
        # Parse only what the front needs: every chunk of a session turn (to store it),
        # else the last one (usage) and errors.
        if self.turn is None and '"finish_reason":null' in payload and '"error"' not in payload:
            return line + "\n\n"
        obj = _loads(payload)
        if not isinstance(obj, dict):
            return line + "\n\n"
        if "error" in obj:
            self.done = True
            self.outcome = "error"
            err = engine_refusal(500, obj)
            return sse_event(err)
        if self.turn is not None:
            self.turn.feed(obj)
        if obj.get("usage") is not None:
            self.usage_seen = True
            self.usage = obj["usage"]
            metrics.observe_timings(obj.get("timings"))
            if isinstance(self.usage, dict) and isinstance(
                self.usage.get("completion_tokens"), int
            ):
                metrics.completion_tokens.inc(self.usage["completion_tokens"])
            # OpenAI's shape: the last choice chunk carries no usage; a separate chunk
            # with empty choices does, and only when the client asked for it.
            usage = obj.pop("usage")
            out = f"data: {json.dumps(obj, ensure_ascii=False)}\n\n" if obj.get("choices") else ""
            if self.gen.include_usage:
                tail = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
                tail.update(choices=[], usage=usage)
                if self.gen.turn is not None and self.gen.turn.dropped_messages:
                    tail["slmguard"] = {
                        "session": {"dropped_messages": self.gen.turn.dropped_messages}
                    }
                out += f"data: {json.dumps(tail, ensure_ascii=False)}\n\n"
            return out or None
        return line + "\n\n"

    async def finished(self) -> None:
        if self.recorded:
            return
        self.recorded = True
        if self.turn is not None:
            await _record(self.ctx, self.gen, self.turn.message(), self.usage)

    def broken(self) -> str:
        self.done = True
        err = gone_error(self.ctx, self.flight)
        self.outcome = "aborted" if self.flight.abort_reason is not None else "engine_died"
        if self.flight.abort_reason is not None:
            self.ctx.metrics.cancelled.labels(self.flight.abort_code).inc()
        return sse_event(err)


class _TurnBuilder:
    """Assembles the assistant message of choice 0 from streamed deltas."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}

    def feed(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                self.content.append(delta["content"])
            if isinstance(delta.get("reasoning_content"), str):
                self.reasoning.append(delta["reasoning_content"])
            for call in delta.get("tool_calls") or ():
                if not isinstance(call, dict):
                    continue
                slot = self.calls.setdefault(
                    int(call.get("index", 0)),
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if call.get("id"):
                    slot["id"] = call["id"]
                fn = call.get("function") or {}
                if fn.get("name"):
                    slot["function"]["name"] += fn["name"]
                if fn.get("arguments"):
                    slot["function"]["arguments"] += fn["arguments"]

    def message(self) -> Message:
        out: Message = {"role": "assistant", "content": "".join(self.content) or None}
        if self.calls:
            out["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        elif out["content"] is None:
            out["content"] = ""
        if self.reasoning:
            out["reasoning_content"] = "".join(self.reasoning)
        return out
