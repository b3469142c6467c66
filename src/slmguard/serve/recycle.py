"""Recycling the engine: drain it, restart it, resume it, without failing a request.

Owns :func:`recycle`, what :meth:`slmguard.serve.control.GovernedEngine.recycle` does
when the governor's leak check (:mod:`slmguard.governor.recycling`) finds the engine's
private memory drifting past its planned bound:

1. **stop admitting**: ``engine.recycling`` is set, so the relay queues new generations
   behind the recycle instead of sending them (or refusing them while it restarts);
2. **drain**: take every slot of the queue (first come, first served: the generations
   in flight and those already waiting finish on the old engine first), within
   ``drain_timeout_s``; past it, give up and report ``postponed`` (nothing was done,
   nothing failed). Then hold the front's other calls to the engine (tokenize,
   apply-template of requests still being prepared) and let those under way finish;
3. **restart**: the child is replaced by a fresh one with the same settings
   (``EngineProcess.reconfigure``: on purpose, no backoff, no restart counted) and
   waited for until it serves;
4. **resume**: the held calls go on, the slots are given back and the queued
   generations run on the new engine.

Sessions live in the front's store and are untouched; the engine's prompt cache is lost
(the next turn of a session is prompt-processed again). Nothing here knows HTTP.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from slmguard.governor.leaks import RecycleOutcome
from slmguard.serve.engine import EngineProcess
from slmguard.serve.flights import Flights
from slmguard.serve.queue import SlotQueue

#: How often the drain looks whether the calls under way (tokenize ...) have finished.
CALLS_POLL_S = 0.01


async def recycle(
    engine: EngineProcess,
    queue: SlotQueue,
    flights: Flights,
    *,
    drain_timeout_s: float,
    ready_timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> RecycleOutcome:
    """Drain, restart and resume the engine (see the module docstring). Raises
    EngineError when the fresh engine does not come up (the previous settings are
    restarted by the supervisor, as after any failed reconfigure)."""
    pid_before = engine.pid
    started = clock()
    engine.recycling = True
    try:
        try:
            taken = await asyncio.wait_for(
                queue.acquire(queue.slots, bypass_limit=True), drain_timeout_s
            )
        except asyncio.exceptions.TimeoutError:
            return RecycleOutcome(pid_before, engine.pid, clock() - started, 0.0, postponed=True)
        engine.hold_calls(True)
        try:
            # Calls under way (no slot: a tokenize of a request being prepared) end first.
            while len(flights) and clock() - started < drain_timeout_s:
                await asyncio.sleep(CALLS_POLL_S)
            drained = clock()
            waiting = queue.waiting
            await engine.reconfigure(engine.config, timeout_s=ready_timeout_s)
        finally:
            engine.hold_calls(False)
            queue.release(taken)
    finally:
        engine.recycling = False
    return RecycleOutcome(
        pid_before, engine.pid, drained - started, clock() - drained, waiting=waiting
    )
