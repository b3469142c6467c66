"""Requests in flight on the engine: what runs, since when, how far it got, how to stop it.

Owns the registry of work the front has sent to the engine: generations, and
the tokenize calls before them (which hold no slot). Each :class:`Flight` knows
its endpoint, when it started, the last time the engine showed progress on it
(a streamed token, a prompt batch), and the task doing its upstream I/O, so the
governor can abort the newest generation (its client gets 503 with the reason)
and the liveness check can see which request is stuck (the whole engine's, or one
request's alone: :func:`slmguard.serve.liveness.stuck_alone`) and what to
blame of it (its body, client and grammar, for the crash memory).
Nothing here does I/O.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from slmguard.errors import SlmguardError, envelope


@dataclass
class Flight:
    id: int
    endpoint: str
    stream: bool
    slots: int
    started_s: float
    last_progress_s: float
    tokens: int = 0
    engine_pid: int | None = None  # the engine child that ran it (crash memory)
    # The generation's body as the engine got it (crash memory: a stall on an engine
    # without the grammar bound blames it); None for the calls before a generation
    # (tokenize, apply-template).
    body: Any = field(default=None, repr=False)
    client: str | None = None  # the client's address (its strikes, its cooldown)
    grammar: str | None = None  # the request field its grammar came from (None: none)
    # Why the server stopped it: the error its client gets (RequestAbortedError,
    # GenerationStalledError, EngineStalledError); None while nobody did.
    aborted: SlmguardError | None = None
    task: asyncio.Task[object] | None = field(default=None, repr=False)
    # When the engine last sent a line of its stream, as the front read it off the
    # socket (the relay to the client may lag behind: a slow reader); None until then.
    heard_s: float | None = None
    # The relay waits on its client (a send held by flow control: a slow reader), so it
    # reads nothing of the engine's meanwhile: its silence says nothing of the engine.
    writing: bool = False

    @property
    def abort_code(self) -> str:
        """The envelope code of the abort (the metrics' cancellation reason)."""
        return (envelope(self.aborted).code if self.aborted else None) or "aborted"

    def progress(self, now_s: float, tokens: int = 0) -> None:
        self.last_progress_s = now_s
        self.tokens += tokens

    def heard(self, now_s: float) -> None:
        """The engine sent a line of this stream (its slot took a step just before)."""
        self.heard_s = now_s

    def abort(self, error: SlmguardError) -> bool:
        """Stop this generation on the server's behalf, its client to get ``error``;
        False when it already ended."""
        if self.aborted is None:
            self.aborted = error
        task = self.task
        if task is None or task.done():
            return False
        task.cancel()
        return True


class Flights:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._ids = itertools.count(1)
        self._open: dict[int, Flight] = {}
        self.events = 0  # progress events of every flight so far (streamed events)
        self.closed = 0  # generations (flights holding slots) finished, however they ended

    def open(self, endpoint: str, *, stream: bool, slots: int) -> Flight:
        now = self.clock()
        flight = Flight(next(self._ids), endpoint, stream, slots, now, now)
        self._open[flight.id] = flight
        return flight

    def progressed(self, flight: Flight, now_s: float, tokens: int = 1) -> None:
        """The engine moved on ``flight`` (a streamed event)."""
        flight.progress(now_s, tokens)
        self.events += 1

    def close(self, flight: Flight) -> None:
        if self._open.pop(flight.id, None) is not None and flight.slots:
            self.closed += 1

    def __iter__(self) -> Iterator[Flight]:
        return iter(list(self._open.values()))

    def __len__(self) -> int:
        return len(self._open)

    def newest(self) -> Flight | None:
        """The newest generation (a request holding a slot; not a tokenize call)."""
        return max((f for f in self._open.values() if f.slots), key=lambda f: f.id, default=None)

    def abort_all(self, error: SlmguardError) -> int:
        return sum(1 for f in self if f.abort(error))

    def last_progress_s(self) -> float | None:
        """The most recent progress of any flight (None when nothing is in flight)."""
        return max((f.last_progress_s for f in self._open.values()), default=None)
