"""One streamed generation, from the engine's socket to the client's, in one task.

Owns the relay of an SSE stream: :class:`StreamTask` sends the request and reads
the engine's answer; once its status is 200 the route answers with
:class:`SSEResponse`, which hands that task the client's ``send``, and the same
task passes each line through :class:`LineRelay` (progress for the liveness
check, usage, the session turn, errors in each API's shape) and writes it: no
queue between a reader and a writer, one loop pass per token. The task is the
flight's: the governor, the liveness check or the client going away cancel it.
It reaches the relay that admitted it only through :class:`StreamOwner` (the
engine's stream, progress, usage, the record, a broken stream's error), never
its engine, queue or metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol

from starlette.responses import Response

from slmguard.errors import EngineUnreachableError, SlmguardError
from slmguard.serve.answers import (
    EVENT_STREAMS,
    TurnBuilder,
    add_usage,
    completion_tokens,
    engine_refusal,
    event_usage,
    loads,
)
from slmguard.serve.envelope import anthropic_sse_event, sse_event

if TYPE_CHECKING:
    from slmguard.serve.flights import Flight
    from slmguard.serve.generation import Generation, Message
    from slmguard.serve.upstream import EngineStream

Send = Callable[[dict[str, Any]], Awaitable[None]]
#: Named events the front reads (None: a data line without a name, as an error comes).
_READ_EVENTS = frozenset({None, "error", "response.completed", "message_delta", "message_stop"})


class StreamOwner(Protocol):
    """What a stream gets from the relay that admitted it, and all it reaches of it.

    The relay implements it (:class:`slmguard.serve.relay.Relay` ``.streams``); the
    stream knows nothing else of the relay, its engine, queue or metrics.
    """

    def open(self, gen: Generation) -> AbstractAsyncContextManager[EngineStream]:
        """The engine's stream of ``gen`` (leaving it closes the engine's connection)."""

    def progressed(self, flight: Flight, now_s: float) -> None:
        """The engine moved on ``flight`` (progress for the liveness check)."""

    def first_token(self, seconds: float) -> None:
        """The first event came ``seconds`` after the request arrived."""

    def next_token(self, seconds: float) -> None:
        """Another event came ``seconds`` after the last one."""

    def account(self, generated: int | None, timings: Any) -> None:
        """Count an answer's generated tokens and the engine's timings of it."""

    async def record(self, gen: Generation, answer: Message | None, usage: Any) -> None:
        """Store a finished session turn."""

    def refusal(self, gen: Generation, flight: Flight, err: SlmguardError) -> SlmguardError:
        """The engine refused ``gen`` mid-stream (an error event): ``err``, counted
        against its client when it proves the request harmful (its grammar bound)."""

    def broken(self, gen: Generation, flight: Flight) -> SlmguardError:
        """The error of a stream that did not end (the server's abort, or the engine
        gone), counted as such."""


class StreamTask:
    """The task relaying one stream: the engine's status first (:attr:`head`), then,
    once :meth:`attach` gives it the client's ``send``, every line."""

    def __init__(self, owner: StreamOwner, gen: Generation, flight: Flight) -> None:
        loop = asyncio.get_running_loop()
        self.owner, self.gen, self.flight = owner, gen, flight
        #: (status, body of a refusal), or None when the stream ended before a status.
        self.head: asyncio.Future[tuple[int, bytes] | None] = loop.create_future()
        self.lines = LineRelay(owner, gen, flight)
        self._send: asyncio.Future[Send] = loop.create_future()
        self.task: asyncio.Task[None] = asyncio.create_task(self._run())
        self.task.add_done_callback(self._ended)
        flight.task = self.task

    def attach(self, send: Send) -> None:
        self._send.set_result(send)

    def _ended(self, _: object) -> None:
        if not self.head.done():
            self.head.set_result(None)

    async def _run(self) -> None:
        with contextlib.suppress(EngineUnreachableError):  # the stream broke: its end says so
            async with self.owner.open(self.gen) as resp:
                if resp.status_code != 200:
                    self.head.set_result((resp.status_code, await resp.aread()))
                    return
                self.head.set_result((200, b""))
                send = await self._send
                await self._relay(resp.aiter_lines(), send)

    async def _relay(self, lines: Any, send: Send) -> None:
        flight, relay = self.flight, self.lines
        async for line in lines:
            if not line:
                continue
            flight.heard_s = time.monotonic()
            out = relay.line(line)
            if relay.done and relay.usage_seen:
                # Before the last event goes out: a client may close the stream the
                # moment it reads [DONE], which cancels this task.
                await relay.finished()
            if out:
                flight.writing = True
                try:
                    await send({"type": "http.response.body", "body": out.encode(),
                                "more_body": True})  # fmt: skip
                finally:
                    flight.writing = False


class SSEResponse(Response):
    """The client's side of a :class:`StreamTask`: the head, then the task's lines, then
    the error of a stream that did not end (the engine gone, the server's abort); the
    client going away cancels the task. ``finish(outcome)`` runs once, at the end."""

    media_type = "text/event-stream"

    def __init__(
        self, stream: StreamTask, headers: dict[str, str], finish: Callable[[str], None]
    ) -> None:
        # As starlette's StreamingResponse: no body, so no Content-Length.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self.stream = stream
        self.finish = finish

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        stream = self.stream
        task = stream.task
        gone = asyncio.create_task(_client_gone(receive))
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})  # fmt: skip
            stream.attach(send)
            ended, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if task in ended:
                if not stream.lines.done:
                    last = stream.lines.broken().encode()
                    await send({"type": "http.response.body", "body": last, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()  # the client went away (or the server stops)
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self.finish(stream.lines.outcome)


async def _client_gone(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class LineRelay:
    """Relays one SSE stream line by line and keeps what the front needs from it."""

    def __init__(self, owner: StreamOwner, gen: Generation, flight: Flight) -> None:
        self.owner = owner
        self.gen = gen
        self.flight = flight
        self.done = False
        self.usage_seen = False
        self.recorded = False
        self.outcome = "client_disconnected"
        self.last_s: float | None = None
        self.turn = TurnBuilder() if gen.turn is not None else None
        self.usage: Any = None
        self.events = gen.endpoint in EVENT_STREAMS
        self.event: str | None = None  # the ``event:`` line before the next data line
        self.head: dict[str, Any] = {}  # id, object, created, model of the usage chunk

    def line(self, line: str) -> str | None:
        if line.startswith(":"):
            return line + "\n\n"  # the engine's keep-alive comment: pass it on
        if line.startswith("event: ") and self.events:
            self.event = line[7:]
            return None
        if not line.startswith("data: "):
            return None
        payload = line[6:]
        if payload == "null":
            return None  # a task's begin marker the engine lets through: no event at all
        if payload == "[DONE]":
            self.done = True
            self.outcome = "ok"
            return self._usage_tail() + "data: [DONE]\n\n"
        if self.events:
            event, self.event = self.event, None
            return self._event(event, payload)
        self._progressed()
        # Parse only what the front needs: every chunk of a session turn (to store it),
        # else the last one (usage) and errors.
        if self.turn is None and '"finish_reason":null' in payload and '"error"' not in payload:
            return line + "\n\n"
        obj = loads(payload)
        if not isinstance(obj, dict):
            return line + "\n\n"
        if "error" in obj:
            self.done = True
            self.outcome = "error"
            return self._error(self._refused(obj))
        if self.turn is not None:
            self.turn.feed(obj)
        if obj.get("usage") is not None:
            return self._last(obj)
        return line + "\n\n"

    def _event(self, event: str | None, payload: str) -> str | None:
        """One named event of a Responses or Messages stream, passed on as it came; the
        ones that carry usage or end the stream are read."""
        self._progressed()
        out = (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"
        if event not in _READ_EVENTS:
            return out
        obj = loads(payload)
        if not isinstance(obj, dict):
            return out
        if event is None or event == "error":
            if event is None and "error" not in obj:
                return out
            self.done = True
            self.outcome = "error"
            return self._error(self._refused(obj if event is None else {"error": obj}))
        completion, timings = event_usage(event, obj)
        self.owner.account(completion, timings)
        if event in ("response.completed", "message_stop"):
            self.done = self.usage_seen = True
            self.outcome = "ok"
        return out

    def _refused(self, obj: dict[str, Any]) -> SlmguardError:
        """The engine's error event as the front's error (its grammar bound: a strike)."""
        err = engine_refusal(500, obj, grammar_param=self.flight.grammar)
        return self.owner.refusal(self.gen, self.flight, err)

    def _progressed(self) -> None:
        now = time.monotonic()
        owner = self.owner
        owner.progressed(self.flight, now)
        if self.last_s is None:
            owner.first_token(now - self.gen.arrived_s)
        else:
            owner.next_token(now - self.last_s)
        self.last_s = now

    def _last(self, obj: dict[str, Any]) -> str | None:
        """A chunk with usage (one per choice): counted, summed, and sent without it."""
        self.usage_seen = True
        usage = obj.pop("usage")
        self.owner.account(completion_tokens("chat", usage), obj.get("timings"))
        choices = [c for c in obj.get("choices") or () if isinstance(c, dict)]
        # A prompt is counted once: with its first choice (index p*n), or, for a usage
        # chunk without choices (chat's), with the first such chunk.
        if choices:
            first = all(int(c.get("index", 0)) % self.gen.per_prompt == 0 for c in choices)
        else:
            first = self.usage is None
        self.usage = add_usage(self.usage, usage, prompt=first)
        # OpenAI's shape: the last choice chunk carries no usage; a separate chunk
        # with empty choices does (before [DONE]), and only when the client asked for it.
        self.head = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        if obj.get("choices"):
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
        return None

    def _usage_tail(self) -> str:
        if not self.gen.include_usage or self.usage is None:
            return ""
        tail: dict[str, Any] = {**self.head, "choices": [], "usage": self.usage}
        if self.gen.turn is not None and self.gen.turn.dropped_messages:
            tail["slmguard"] = {"session": {"dropped_messages": self.gen.turn.dropped_messages}}
        return f"data: {json.dumps(tail, ensure_ascii=False)}\n\n"

    def _error(self, err: SlmguardError) -> str:
        if self.gen.endpoint == "messages":
            return anthropic_sse_event(err)
        return sse_event(err)

    async def finished(self) -> None:
        if self.recorded:
            return
        self.recorded = True
        if self.turn is not None:
            await self.owner.record(self.gen, self.turn.message(), self.usage)

    def broken(self) -> str:
        """The last event of a stream that did not end: the server's abort, or the engine gone."""
        self.done = True
        self.outcome = "aborted" if self.flight.aborted is not None else "engine_died"
        return self._error(self.owner.broken(self.gen, self.flight))
