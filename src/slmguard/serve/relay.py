"""One engine's generations: admit them, run them, collect or stream the answer, record it.

Owns :class:`Relay`, what happens to a prepared
:class:`~slmguard.serve.generation.Generation` between its route and the
llama-server the relay drives: **admit** (the crash memory's 429 for a client
cooling down and 400 for a request an engine proved harmful, the policy's
refusal, the engine's state, a place in the slot queue or 429), **run** (the
body sent as prepared; a stream relayed by :mod:`slmguard.serve.stream`, which
reaches the relay only through :attr:`Relay.streams`), **collect** (a JSON
answer as it came, several choices gathered from the engine's stream by
:mod:`slmguard.serve.gather`; the client going away or the server's abort
cancels the upstream request) and **record** (usage counted, a session's turn
stored); and the watched engine calls the dialects make before (:meth:`Relay.call`).
Every 503 it raises about its engine (not ready, gone, busy) carries the Retry-After
that engine is expected back by (:meth:`Relay.retry_after_s`,
:mod:`slmguard.serve.readiness`).
It does not prepare or size a request (:mod:`slmguard.serve.dialects`,
:mod:`slmguard.serve.sizing`) nor map errors to HTTP (the envelope's).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from slmguard.errors import (
    EngineError,
    EngineGoneError,
    EngineNotReadyError,
    EngineStalledError,
    EngineUnreachableError,
    GrammarLimitError,
    SlmguardError,
    envelope,
)
from slmguard.governor.request import RequestPolicy, SizedRequest
from slmguard.serve.answers import completion_tokens, engine_refusal, loads, usage_count
from slmguard.serve.blame import CrashMemory
from slmguard.serve.bounds import grammar_field
from slmguard.serve.engine import EngineProcess
from slmguard.serve.flights import Flight, Flights
from slmguard.serve.gather import gathering
from slmguard.serve.generation import Generation, Message
from slmguard.serve.metrics import ModelMetrics
from slmguard.serve.queue import SlotQueue
from slmguard.serve.readiness import RetryAfter
from slmguard.serve.sessions import SessionService
from slmguard.serve.sizing import Sizing

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

    from slmguard.serve.upstream import EngineStream

log = logging.getLogger(__name__)


def outcome(err: SlmguardError) -> str:
    """The metrics outcome of a refused request (by its HTTP status)."""
    status = envelope(err).status
    return {429: "rejected_queue_full", 503: "unavailable", 413: "too_large"}.get(
        status, "client_error" if status < 500 else "error"
    )


class Relay:
    """The generations of one engine (see the module docstring).

    ``policy`` is asked before the queue; ``sizing`` says why an answer the engine
    refused for its context does not fit (the context shrank since it was sized);
    ``retry_after`` bounds the Retry-After of its 503s about the engine.
    """

    def __init__(
        self,
        engine: EngineProcess,
        queue: SlotQueue,
        flights: Flights,
        metrics: ModelMetrics,
        policy: RequestPolicy,
        sizing: Sizing,
        *,
        retry_after: RetryAfter,
        sessions: SessionService | None,
        crashes: CrashMemory | None = None,
    ) -> None:
        self.engine = engine
        self.queue = queue
        self.flights = flights
        self.metrics = metrics
        self.policy = policy
        self.sizing = sizing
        self.sessions = sessions
        self.retry_after = retry_after
        self.crashes = crashes if crashes is not None else CrashMemory()

    @functools.cached_property
    def streams(self) -> _StreamSide:
        """What a stream reaches of this relay (:class:`~slmguard.serve.stream.StreamOwner`)."""
        return _StreamSide(self)

    # ------------------------------------------------------------------ the engine's answers

    def retry_after_s(self, *, died: bool = False) -> int:
        """The Retry-After of a 503 about this engine now: when it is expected to serve
        again (``died``: a request found it gone, its supervisor may not know yet)."""
        return self.retry_after.seconds(self.engine.readiness(), died=died)

    def later(self, err: SlmguardError, *, died: bool = False) -> SlmguardError:
        """``err`` with :meth:`retry_after_s`, when it is a 503 of the engine naming none."""
        if not isinstance(err, EngineError) or err.retry_after_s is not None:
            return err
        if envelope(err).status == 503:
            err.retry_after_s = self.retry_after_s(died=died)
        return err

    def unavailable(self, err: Exception | None = None) -> SlmguardError:
        """503 for a request the engine cannot take now: its state, or why it did not answer."""
        state = self.engine.state
        if state == "ready" and err is not None:
            # Running, yet the request failed on its way: say so (and log it: it is a bug
            # or a resource limit of the engine, or its death not yet reaped).
            log.warning("the engine did not answer (%s) although it is ready", err)
            gone = EngineUnreachableError(f"the engine did not answer ({err}); retry shortly")
            return self.later(gone, died=True)
        return self.later(EngineNotReadyError(state))

    def gone(self, flight: Flight) -> SlmguardError:
        """The error when the engine stopped answering during ``flight``: the server's
        abort, a stall, or the engine's death."""
        if flight.aborted is not None:
            return self.later(flight.aborted, died=True)
        err = EngineStalledError() if self.engine.state == "stalled" else EngineGoneError()
        return self.later(err, died=True)

    def refused(self, status: int, data: Any, *, grammar_param: str | None = None) -> SlmguardError:
        """The engine's own error answer (:func:`~slmguard.serve.answers.engine_refusal`);
        its 503 (busy, or still loading) with this engine's Retry-After."""
        return self.later(engine_refusal(status, data, grammar_param=grammar_param))

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes, str]:
        """One engine request outside a generation (tokenize, apply-template), watched.

        It is pending work like a generation: registered in ``flights`` (no slot),
        so the liveness check sees a wedged engine that never answers it and aborts it
        (503 ``engine_stalled``) instead of leaving the client hanging.
        """
        await self.engine.calls_open()  # held while a recycle restarts the engine
        flight = self.flights.open(path, stream=False, slots=0)
        task = asyncio.ensure_future(self.engine.client.request(method, path, body))
        flight.task = task
        try:
            return await task
        except asyncio.CancelledError:
            task.cancel()
            if flight.aborted is None:
                raise  # the client went away
            raise self.gone(flight) from None
        except EngineUnreachableError as err:
            raise self.unavailable(err) from err
        finally:
            self.flights.close(flight)

    async def call_json(self, path: str, body: Any) -> Any:
        """POST ``body`` (watched); the engine's JSON answer, or its refusal raised."""
        status, raw, _ = await self.call("POST", path, body)
        data = loads(raw)
        if status != 200:
            raise self.refused(status, data)
        return data

    # ------------------------------------------------------------------ admit

    async def admit(self, gen: Generation) -> int:
        """The policy's verdict, then slots in the queue; returns the slots taken."""
        refusal = self.policy.admit(gen.sized)
        if refusal is not None:
            raise refusal
        if self.engine.state != "ready" and not self.engine.recycling:
            raise self.unavailable()  # a recycle's restart: wait in the queue behind it
        taken = await self.queue.acquire(gen.sized.n)  # QueueFullError: 429
        if self.engine.state != "ready":  # it went away while this one waited
            self.queue.release(taken)
            raise self.unavailable()
        return taken

    # ------------------------------------------------------------------ run, collect, record

    def engine_died(self, gen: Generation, flight: Flight) -> None:
        """The engine went away under ``flight``: it stays a suspect of the crash memory
        (blamed if it was the last one that engine got and the engine crashed), unless the
        server stopped that engine itself (a park or a reconfigure by the governor)."""
        if self.engine.exited_on_purpose(flight.engine_pid):
            self.answered(flight)

    def answered(self, flight: Flight) -> None:
        """The engine answered ``flight`` (or dropped it: its client left, the server
        aborted it): not running there any more, no suspect of a crash."""
        self.crashes.finished(flight.engine_pid, flight.id)

    def refusal(self, gen: Generation, flight: Flight, err: SlmguardError) -> SlmguardError:
        """The engine refused ``gen``: a grammar past its work bound is a strike."""
        if isinstance(err, GrammarLimitError):
            self.crashes.grammar_refused(gen.body, flight.client, err.param)
        return err

    async def run(self, request: Request, gen: Generation) -> Response:
        """Admit and relay one generation; every outcome is counted."""
        client = request.client.host if request.client is not None else None
        try:
            self.crashes.check(gen.body, client)
            taken = await self.admit(gen)
        except SlmguardError as err:
            self.metrics.requests.labels(gen.endpoint, outcome(err)).inc()
            raise
        flight = self.flights.open(gen.endpoint, stream=gen.stream, slots=taken)
        flight.engine_pid = self.engine.pid
        flight.body = gen.body  # blamed for a stall on a build without the grammar bound
        flight.client = client
        flight.grammar = grammar_field(gen.endpoint, gen.body)
        self.crashes.sent(flight.engine_pid, flight.id, gen.body, client, flight.grammar)
        if not gen.prompt_from_answer:
            self.metrics.prompt_tokens.inc(gen.prompt_total or gen.sized.prompt_tokens)
        done = _Done(self.flights, self.queue, flight, taken)
        try:
            if gen.stream:
                return await self._stream(gen, flight, done)
            return await self._collect(request, gen, flight, done)
        except BaseException:
            done()
            raise

    async def _collect(
        self, request: Request, gen: Generation, flight: Flight, done: _Done
    ) -> Response:
        from fastapi.responses import JSONResponse, Response

        upstream = asyncio.create_task(
            self._gather(gen, flight)
            if gen.gathered
            else self.engine.client.request("POST", gen.path, gen.body)
        )
        flight.task = upstream
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            finished, _ = await asyncio.wait(
                {upstream, watcher}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            watcher.cancel()
        if upstream not in finished:
            upstream.cancel()
            self.answered(flight)
            self.metrics.requests.labels(gen.endpoint, "client_disconnected").inc()
            self.metrics.cancelled.labels("client").inc()
            log.info("client went away; %s generation %d cancelled", gen.endpoint, flight.id)
            done()
            return JSONResponse({}, status_code=499)
        done()
        if upstream.cancelled() or isinstance(upstream.exception(), EngineUnreachableError):
            aborted = flight.aborted is not None  # by the server, else the engine went away
            ended = "aborted" if aborted else "engine_died"
            self.metrics.requests.labels(gen.endpoint, ended).inc()
            if aborted:
                self.answered(flight)
                self.metrics.cancelled.labels(flight.abort_code).inc()
            else:
                self.engine_died(gen, flight)
            raise self.gone(flight)
        status, raw, _ = upstream.result()
        self.answered(flight)
        data = loads(raw)
        if status != 200:
            refused = self.refusal(gen, flight, self._refusal(gen, status, data))
            self.metrics.requests.labels(gen.endpoint, outcome(refused)).inc()
            raise refused
        if not isinstance(data, dict):
            self.metrics.requests.labels(gen.endpoint, "error").inc()
            raise EngineError("the engine's answer is not JSON")
        self.account(completion_tokens(gen.endpoint, data.get("usage")), data.get("timings"))
        if gen.prompt_from_answer:
            self.metrics.prompt_tokens.inc(usage_count(data.get("usage"), "prompt_tokens"))
        choices = data.get("choices") or [{}]
        message = choices[0].get("message") if isinstance(choices[0], dict) else None
        await self.record(gen, message if isinstance(message, dict) else None, data.get("usage"))
        self.metrics.requests.labels(gen.endpoint, "ok").inc()
        headers = gen.session_header()
        if headers and gen.turn is not None:
            said = {"dropped_messages": gen.turn.dropped_messages, "stored": gen.turn.stored}
            data["slmguard"] = {"session": said}
            return JSONResponse(data, headers=headers)
        return Response(raw, media_type="application/json")

    def _refusal(self, gen: Generation, status: int, data: Any) -> SlmguardError:
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict) and err.get("type") == "exceed_context_size_error":
            n_prompt = err.get("n_prompt_tokens")
            if isinstance(n_prompt, int):
                # The context shrank between sizing and the engine (a governor resize).
                sized = SizedRequest(gen.endpoint, n_prompt, gen.body.get("max_tokens") or 0,
                                     n=gen.sized.n, stream=gen.stream)  # fmt: skip
                return self.sizing.context_error(sized)
        return self.refused(status, data, grammar_param=grammar_field(gen.endpoint, gen.body))

    def account(self, generated: int | None, timings: Any) -> None:
        """Count an answer's generated tokens and the engine's timings of it."""
        if generated:
            self.metrics.completion_tokens.inc(generated)
        self.metrics.observe_timings(timings)

    async def _gather(self, gen: Generation, flight: Flight) -> tuple[int, bytes, str]:
        """A completion or chat completion with several choices, streamed by the engine
        and answered whole: every choice's text (or message), finish reason and logprobs,
        the usage summed over them."""
        gathered = gathering(gen.endpoint, gen.per_prompt)
        async with self.engine.client.stream(gen.path, gen.body) as resp:
            if resp.status_code != 200:
                return resp.status_code, await resp.aread(), "application/json"
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line in ("data: [DONE]", "data: null"):
                    continue
                obj = loads(line[6:])
                if isinstance(obj, dict) and "error" in obj:
                    return 500, json.dumps(obj).encode(), "application/json"
                if isinstance(obj, dict):
                    self.flights.progressed(flight, time.monotonic())
                    gathered.feed(obj)
        return 200, json.dumps(gathered.answer(), ensure_ascii=False).encode(), "application/json"

    async def record(self, gen: Generation, answer: Message | None, usage: Any) -> None:
        """Store a finished session turn; a store failure is logged, not sent."""
        if gen.turn is None or self.sessions is None or answer is None:
            return
        out: Message = {"role": "assistant", "content": answer.get("content")}
        for key in ("tool_calls", "reasoning_content"):
            if answer.get(key):
                out[key] = answer[key]
        usage = usage if isinstance(usage, dict) else {}
        try:
            await self.sessions.record_turn(
                gen.turn.session_id, gen.turn.new_messages, out,
                prompt_tokens=int(usage.get("prompt_tokens") or gen.sized.prompt_tokens),
                completion_tokens=int(usage.get("completion_tokens") or 1),
            )  # fmt: skip
        except (SlmguardError, OSError) as err:
            gen.turn.stored = False  # said in the answer (X-Slmguard-Session-Stored: false)
            log.error("session %s: the turn was not stored: %s", gen.turn.session_id, err)

    async def _stream(self, gen: Generation, flight: Flight, done: _Done) -> Response:
        """A stream: the engine's status decides the answer (its refusal relayed, or the
        stream's head); then :class:`~slmguard.serve.stream.StreamTask` relays each line."""
        from slmguard.serve.stream import SSEResponse, StreamTask

        stream = StreamTask(self.streams, gen, flight)
        try:
            head = await stream.head
        except BaseException:
            stream.task.cancel()
            raise
        if head is None:
            done()
            if flight.aborted is None:
                self.engine_died(gen, flight)
            else:
                self.answered(flight)
            self.metrics.requests.labels(gen.endpoint, "engine_died").inc()
            raise self.gone(flight)
        status, raw = head
        if status != 200:
            done()
            self.answered(flight)
            err = self.refusal(gen, flight, self._refusal(gen, status, loads(raw)))
            self.metrics.requests.labels(gen.endpoint, outcome(err)).inc()
            raise err

        def finish(ended: str) -> None:
            if ended != "engine_died":
                self.answered(flight)
            if ended == "client_disconnected":
                self.metrics.cancelled.labels("client").inc()
            self.metrics.requests.labels(gen.endpoint, ended).inc()
            done()

        return SSEResponse(stream, gen.session_header(), finish)


class _Done:
    """Closes a generation's flight and gives its slots back, once."""

    def __init__(self, flights: Flights, queue: SlotQueue, flight: Flight, taken: int) -> None:
        self.flights, self.queue, self.flight, self.taken = flights, queue, flight, taken

    def __call__(self) -> None:
        self.flights.close(self.flight)
        if self.taken:
            self.queue.release(self.taken)
            self.taken = 0


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _StreamSide:
    """The relay as a stream sees it: :class:`~slmguard.serve.stream.StreamOwner`.

    The per-event hooks are the bound methods themselves (no call in between: a
    relayed token costs the front one pass of the loop, benchmarks/serve_overhead.py).
    """

    def __init__(self, relay: Relay) -> None:
        self._relay = relay
        self.progressed = relay.flights.progressed
        self.first_token = relay.metrics.ttft.observe
        self.next_token = relay.metrics.token_latency.observe
        self.account = relay.account
        self.record = relay.record
        self.refusal = relay.refusal

    def open(self, gen: Generation) -> AbstractAsyncContextManager[EngineStream]:
        return self._relay.engine.client.stream(gen.path, gen.body)

    def broken(self, gen: Generation, flight: Flight) -> SlmguardError:
        relay = self._relay
        err = relay.gone(flight)
        if flight.aborted is not None:
            relay.metrics.cancelled.labels(flight.abort_code).inc()
        else:
            relay.engine_died(gen, flight)
        return err
