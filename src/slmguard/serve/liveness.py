"""Liveness that exercises decode: a wedged engine is found, reported and replaced.

Owns the decision "the engine is stuck" and what follows it (:class:`Liveness`):
progress of the decode loop, not pings (streamed events and ``/slots``
answers); one request stuck alone cancelled alone (:func:`stuck_alone`); the
stall time derived from the engine's own step, timed by a step probe bounded so
that a stopped engine is found from the first second (:func:`stall_after_s`,
:func:`full_probe_bound_s`, :func:`probe_request`); the idle canary and ``/slots``
refresh; on a stall, the evidence written, the requests in flight ended (blamed
only on a build without the grammar bound) and the child killed for a restart;
and whether to feed systemd's watchdog. The rules and why: :class:`Liveness` and
docs/serve.md, *When the engine is wedged*. It never starts or restarts the
engine itself (the engine's) nor answers a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slmguard import paths
from slmguard.errors import EngineStalledError, EngineUnreachableError, GenerationStalledError
from slmguard.host.files import ROOT
from slmguard.host.process import read_kernel_stack, read_thread_states
from slmguard.serve.blame import CrashMemory
from slmguard.serve.engine import EngineProcess
from slmguard.serve.flights import Flight, Flights
from slmguard.serve.llamaserver import RANK_POOLING
from slmguard.serve.queue import SlotQueue
from slmguard.serve.slots import SlotState, SlotsView

if TYPE_CHECKING:
    from slmguard.serve.metrics import ModelMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LivenessSettings:
    floor_s: float = 15.0
    factor: float = 8.0
    fixed_s: float | None = None  # --stall-timeout-s: no derivation
    canary_interval_s: float = 120.0  # 0: no canary
    poll_s: float = 1.0


def stall_after_s(cfg: LivenessSettings, step_s: float | None) -> float:
    """The stall time: ``factor`` x the longest single engine step the front measured
    itself (``step_s``, the step probe), at least ``floor_s``; the floor until measured."""
    if cfg.fixed_s is not None:
        return cfg.fixed_s
    return max(cfg.floor_s, cfg.factor * (step_s or 0.0))


#: The step probe's first, small batch (prompt tokens), bounded by the floor: its time,
#: extrapolated to the full batch, bounds the full one.
SMALL_BATCH = 8
#: The full batch of the step probe may take this many times the small batch's time
#: extrapolated to it. The extrapolation already overestimates (a small batch costs
#: several times more per token than a full one on a loaded CPU); the margin is for a
#: neighbour's load rising between the two probes.
PROBE_MARGIN = 2.0


def full_probe_bound_s(
    cfg: LivenessSettings, small_s: float, small_tokens: int, full_tokens: int
) -> float:
    """How long the full batch of the step probe may take before it is a stall:
    :data:`PROBE_MARGIN` x the small batch's time scaled to the full batch's tokens, at
    least the floor. Linear in the tokens: a small batch costs more per token than a full
    one (its fixed costs, a worse use of the matrix kernels), so this overestimates, as a
    bound should; attention's growth over one batch is far inside the margin."""
    scaled = small_s * full_tokens / max(1, small_tokens)
    return max(cfg.floor_s, PROBE_MARGIN * scaled)


#: Tokens the step probe leaves for what an embedding or rerank prompt adds (the query,
#: BOS, EOS, SEP): the pair must stay within one batch, an encoder computes it whole.
_POOLED_MARGIN = 5


def probe_request(pooling_type: int | None, tokens: int) -> tuple[str, dict[str, Any]]:
    """The front's own probe of about ``tokens`` prompt tokens, in the engine's mode: a
    one-token generation (``/completion``); a rerank of one pair on a reranker (pooling
    type rank) and an embedding on an embedding model (any other pooling type): their
    engine runs with ``--reranking`` or ``--embeddings`` and answers a generation 500.

    One token repeated: " a" is one token in every vocabulary we serve; the count only
    has to fill the batch, not to be exact."""
    if pooling_type is None:
        prompt = " a" * tokens if tokens > 1 else "a"
        return "/completion", {"prompt": prompt, "n_predict": 1, "cache_prompt": False,
                               "temperature": 0}  # fmt: skip
    text = " a" * max(1, tokens - _POOLED_MARGIN)
    if pooling_type == RANK_POOLING:
        return "/v1/rerank", {"query": "a", "documents": [text]}
    return "/v1/embeddings", {"input": text}


class SlotMotion:
    """When each of the engine's slots last took a step: its
    :attr:`~slmguard.serve.slots.SlotState.step_key` (task, prompt tokens processed,
    tokens decoded) changed between two ``/slots`` answers. A slot first seen counts as
    moved then; an engine start (a new pid) starts over."""

    def __init__(self) -> None:
        self._keys: dict[int, tuple[int, bool, int, int, int]] = {}
        self._moved_s: dict[int, float] = {}
        self._pid: int | None = None

    def observe(self, slots: Iterable[SlotState], now_s: float, pid: int | None) -> None:
        if pid != self._pid:
            self._keys.clear()
            self._moved_s.clear()
            self._pid = pid
        for slot in slots:
            key = slot.step_key
            if self._keys.get(slot.id) != key:
                self._keys[slot.id] = key
                self._moved_s[slot.id] = now_s

    def moved_since(self, since_s: float) -> int:
        """How many slots took a step at or after ``since_s`` (idle now or not)."""
        return sum(1 for t in self._moved_s.values() if t >= since_s)


def stuck_alone(
    flights: Iterable[Flight],
    moving_slots: int | None,
    now_s: float,
    limit_s: float,
    *,
    idle: bool = False,
) -> list[Flight]:
    """The requests in flight that made no progress for ``limit_s`` while the engine's
    loop did, to cancel alone; ``moving_slots`` is how many slots took a step in that
    time (:meth:`SlotMotion.moved_since`), None when the engine's answer named no slot;
    ``idle``: no slot of the engine's is busy now.

    Each step of llama-server's loop takes a token of every generating slot and prompt
    tokens of the others as the batch allows, so when no slot stepped while some are
    busy the engine is slow (its loop answers ``/slots`` between steps that take
    long on a loaded board): no generation is judged. Otherwise the front, which cannot
    tell which slot runs which request (llama-server picks the slot), counts: a stream
    the engine sent a line of in that time (:attr:`Flight.heard_s`, as read off the
    socket, not as the client reads it) holds a slot that stepped; the slots that
    stepped beyond those may each be running a silent request (a long prefill streams
    nothing; a request without a stream streams nothing at all). Only when none is left
    is every silent generation stuck: it never got a slot, or its slot stopped taking
    steps. When some are left, it cannot be told which silent request is stuck: none
    is. A call before a generation (tokenize, apply-template) holds no slot: silent
    that long while the loop answers, it is stuck. A relay waiting on its client
    (:attr:`Flight.writing`) reads nothing meanwhile: it is not judged."""
    calls: list[Flight] = []
    silent: list[Flight] = []
    streaming = 0
    for flight in flights:
        if flight.aborted is not None or flight.writing:
            continue  # stopped already, or waiting on its client: not the engine's silence
        heard = flight.heard_s if flight.heard_s is not None else flight.started_s
        quiet = now_s - heard >= limit_s
        if not flight.slots:
            if quiet:
                calls.append(flight)
        elif quiet:
            silent.append(flight)
        elif flight.heard_s is not None:
            streaming += flight.slots  # the engine sent lines in that time: its slots moved
        # else young, nothing heard yet: it may hold a moving slot or none
    if moving_slots is None or (moving_slots == 0 and not idle):
        return calls
    if moving_slots - streaming > 0:
        return calls
    return calls + silent


#: How often /slots is asked while every request in flight streams (its answer is then
#: only what /health and top show; the streams prove the engine's progress).
SLOTS_WHILE_STREAMING_S = 5.0


def all_streaming(flights: Iterable[Flight], since_s: float) -> bool:
    """Every request in flight is a generation whose engine sent a line at or after
    ``since_s`` (a call before a generation, a request without a stream, a prefill or a
    relay waiting on its client: not this)."""
    seen = False
    for flight in flights:
        if not flight.slots or flight.writing or (flight.heard_s or -math.inf) < since_s:
            return False
        seen = True
    return seen


class _Preempted(Exception):
    """A request came before the front's own probe could run: it proves decode now."""


class Liveness:
    """The stall detector of one engine. ``metrics`` counts the stalls.

    A ping would not
    do: llama-server's ``/health`` answers from its HTTP threads while its decode
    loop is wedged (a deadlocked kernel, a stuck NPU driver, ``kill -STOP``). So:

    - **Progress, not pings.** While requests are in flight, progress is what the
      engine's decode loop does: every streamed event of any request, and every
      answer to ``GET /slots``, which llama-server serves from that loop between
      two decode steps (a prompt batch or one token of every busy slot). A long
      prefill on a slow board answers between its batches: it is progress. No
      progress for the stall time while work is pending is a stall.
    - **One request stuck alone is cancelled alone.** While the loop answers and
      takes steps, each request's own progress is judged too: the lines of its
      stream as the engine sends them, and the steps of the slots ``/slots`` reports
      (a slot's task, prompt tokens processed and tokens decoded: a long prefill, or
      a request without a stream, is progress of its slot; :class:`SlotMotion`).
      The front cannot tell which slot runs which request, so it counts
      (:func:`stuck_alone`): when no slot that took a step in the stall time is left
      over for the silent requests (beyond those the streaming ones hold), each
      request silent for the stall time is stuck (it never got a slot, or its slot
      stopped taking steps: a task deferred behind another, work of the engine's
      HTTP threads that does not end); when no slot stepped while some are busy (a
      slow engine on a loaded board answers ``/slots`` between long steps) or it
      cannot be told which request is stuck, none is cancelled; a verdict holds at two polls in a
      row before it is acted on. A stuck request is cancelled alone
      (its upstream closed, so llama-server drops the task; its client gets 503
      ``generation_stalled``, or that error event on a stream;
      ``slmguard_request_stalls_total``); the engine keeps running.
    - **The stall time is derived from what no client controls**: ``factor`` times
      the longest single step this engine takes here, measured by the front itself:
      after each engine start, while idle, a *step probe* (one full batch of the
      plan's ``n_batch`` prompt tokens, no cache, one token out; on an embedding model
      or a reranker, whose engine generates nothing, an embedding or a rerank of that
      many tokens: :func:`probe_request`) is timed; never less
      than ``floor_s``; ``--stall-timeout-s`` fixes it instead. The probe is bounded so
      that a stopped engine is found within the stall time from the first second, before
      any request (a request that comes meanwhile waits for the probe): a small batch
      (:data:`SMALL_BATCH` tokens) first, bounded by the floor (the stall time until
      measured), then the full batch, bounded by :data:`PROBE_MARGIN` x the small one's
      time extrapolated to ``n_batch`` (an overestimate: a bigger batch costs less per
      token), at least the floor: a board that needs minutes for one batch (software
      emulation, a Pi under load) is measured, not declared stalled. The engine's timings
      of client requests never feed it: a client could stretch them at will (a
      few-token prompt, a slow grammar), and with them the time a wedged engine goes
      unnoticed. Without the canary (``--canary-interval-s 0``) there is no probe
      and the stall time is the floor.
    - **When idle**, ``/slots`` is asked again while its last answer (taken while a request
      ran) still shows a busy slot, so ``/health`` and top show the slots as they are; a
      canary (a one-token generation, every ``canary_interval_s``;
      0 turns it off; a one-word embedding or rerank on such a model) proves decode
      still works before a client finds out.
    - **On a stall**: the evidence is written first (the stuck request's age, the
      last progress, the child's threads with their states and kernel wait
      channels, its kernel stack where readable, the last engine log lines) to
      ``<state_dir>/stalls/`` for ``slmguard watch``'s crash bundle; the generations
      in flight end with 503 ``engine_stalled`` and are not blamed: with constrained
      decoding bounded in the engine (slmguard's builds) a stall is the engine's, not a
      request's. On a build without that bound the ones carrying a grammar are
      (:meth:`~slmguard.serve.blame.CrashMemory.stalled`: sent again they are refused
      with 400 ``request_crashed_engine`` before they reach the engine, a strike against
      their client; not when the front's own canary or step probe found the stall);
      the child is SIGKILLed (its whole
      process group) and restarted through the usual backoff and restart budget;
      ``/health`` says ``stalled`` at once.

    :meth:`Liveness.watchdog_ok` tells the runner whether to feed systemd's
    watchdog: while the engine progresses, idles healthy, loads, runs the front's
    own canary or step probe (a request that came meanwhile waits for it; the
    probe's own bound ends it, the floor or more on a slow board, possibly longer
    than a 30 s WatchdogSec) or is being restarted within its budget, not once it
    has failed.
    """

    def __init__(
        self,
        engine: EngineProcess,
        flights: Flights,
        queue: SlotQueue,
        slots: SlotsView,
        metrics: ModelMetrics,
        settings: LivenessSettings,
        *,
        state_dir: Path | None,
        crashes: CrashMemory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.flights = flights
        self.queue = queue
        self.slots = slots
        self.metrics = metrics
        self.settings = settings
        self.state_dir = state_dir
        self.crashes = crashes if crashes is not None else CrashMemory()
        self.clock = clock
        self.last_progress_s = clock()
        self.last_canary_s = clock()
        self.progress = 0  # every answered poll or streamed event seen (for /health)
        self.canaries = 0
        self.request_stalls = 0  # requests cancelled alone (no progress while the engine did)
        self.motion = SlotMotion()
        self._suspects: set[int] = set()  # flights judged stuck alone at the last poll
        self._slots_asked_s = -math.inf  # when this check last asked the engine's /slots
        self.step_s: float | None = None  # the step probe's time (the longest step)
        self._probed_pid: int | None = None  # the engine the step probe timed
        self._probing = False  # the front's own canary or step probe holds the engine
        self.last_stall: dict[str, Any] | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ what others ask

    def stall_after_s(self) -> float:
        return stall_after_s(self.settings, self.step_s)

    def since_progress_s(self) -> float:
        latest = max(self.last_progress_s, self.flights.last_progress_s() or 0.0)
        return self.clock() - latest

    def watchdog_ok(self) -> bool:
        """Feed systemd's watchdog? Not once the engine has failed for good."""
        state = self.engine.state
        if state in ("failed", "stopped"):
            return False
        if state != "ready" or not len(self.flights):
            return True  # idle and healthy, loading, restarting within budget, parked
        if self._probing:
            # A request that came during the front's own probe waits for it; the probe
            # is bounded by its own timeout (a stall when it runs out), which on a slow
            # board may be far longer than the floor: systemd must not kill the front first.
            return True
        return self.since_progress_s() < self.stall_after_s()

    def status(self) -> dict[str, Any]:
        return {
            "stall_after_s": round(self.stall_after_s(), 2),
            "since_progress_s": round(self.since_progress_s(), 2),
            "progress": self.progress,
            "canaries": self.canaries,
            "request_stalls": self.request_stalls,
            "canary_interval_s": self.settings.canary_interval_s,
            "step_s": None if self.step_s is None else round(self.step_s, 3),
            "last_stall": self.last_stall,
        }

    # ------------------------------------------------------------ the loop

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self.run(), name="liveness")
        return self._task

    async def aclose(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def run(self) -> None:
        while not self._stop.is_set():
            await self.check()
            with contextlib.suppress(asyncio.exceptions.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.settings.poll_s)

    async def check(self) -> None:
        """One round: poll while busy, canary when idle, act on a stall."""
        engine = self.engine
        now = self.clock()
        if engine.state != "ready":
            self.last_progress_s = now  # nothing is owed while it loads or restarts
            self.last_canary_s = now
            return
        limit = self.stall_after_s()
        if len(self.flights):
            if all_streaming(self.flights, now - self.settings.poll_s) and not self._slots_due():
                # Every request in flight streamed a line since the last round: that is
                # the engine's progress, and none of them is stuck. /slots is asked only
                # now and then (what /health and top show of the slots).
                self._progressed()
                return
            remaining = max(0.5, limit - self.since_progress_s())
            self._slots_asked_s = now
            if await self.slots.refresh(timeout_s=remaining):
                self._progressed()
                self._cancel_stuck_alone(limit)
            elif self.since_progress_s() >= limit:
                await self.stalled("no progress while requests were in flight")
            return
        if any(slot.is_processing for slot in self.slots.current()) and self._slots_due():
            # The last answer came while a request ran: asked again now that the front
            # has nothing in flight, so /health and top do not show an idle slot as busy.
            # Not every round: asked back to back while the engine still finishes a
            # request whose client left, /slots kept it from stopping that generation
            # (test_disconnect_cancels_non_stream_generation).
            self._slots_asked_s = now
            await self.slots.refresh(timeout_s=limit)
        interval = self.settings.canary_interval_s
        if interval > 0 and self.settings.fixed_s is None and self._probed_pid != engine.pid:
            await self.probe_step()
        elif interval > 0 and now - max(self.last_canary_s, self.last_progress_s) >= interval:
            await self.canary(limit)

    def _slots_due(self) -> bool:
        return self.clock() - self._slots_asked_s >= SLOTS_WHILE_STREAMING_S

    def _progressed(self) -> None:
        self.last_progress_s = self.clock()
        self.progress += 1

    def _cancel_stuck_alone(self, limit: float) -> None:
        """The loop answered: a request that made no progress of its own for the stall time
        meanwhile (:func:`stuck_alone`) is cancelled alone, the engine left running."""
        now = self.clock()
        slots = self.slots.current()
        self.motion.observe(slots, now, self.engine.pid)
        # No slot in the answer (an engine whose /slots this front cannot read): nothing
        # to judge a generation by, and its silence alone proves nothing.
        moving = self.motion.moved_since(now - limit) if slots else None
        idle = not any(slot.is_processing for slot in slots)
        stuck = stuck_alone(self.flights, moving, now, limit, idle=idle)
        # Judged stuck at two polls in a row: one answer of the engine's may predate the
        # step behind a line the front has just read.
        confirmed = [f for f in stuck if f.id in self._suspects]
        self._suspects = {f.id for f in stuck}
        for flight in confirmed:
            silent_s = now - (flight.heard_s or flight.started_s)
            if not flight.abort(GenerationStalledError(limit)):
                continue
            self.request_stalls += 1
            self.metrics.request_stalls.inc()
            log.warning(
                "request %d (%s) made no progress for %.1f s while the engine did "
                "(slots that stepped: %s); cancelled alone, the engine left running",
                flight.id, flight.endpoint, silent_s, moving,
            )  # fmt: skip

    async def canary(self, timeout_s: float) -> None:
        """A one-token generation; no answer within the stall time is a stall."""
        self.last_canary_s = self.clock()
        with contextlib.suppress(_Preempted):
            await self._probe(self._request(1), timeout_s, "the idle canary")

    async def probe_step(self) -> None:
        """Time the longest step this engine takes here: one full batch of prompt tokens
        (the plan's ``n_batch``, within one slot), no cache, one token out. The stall
        time derives from it (:func:`stall_after_s`).

        Its bound comes from the front's own measurement too: first a small batch of
        :data:`SMALL_BATCH` tokens, bounded by the floor (the stall time until measured:
        a stopped engine is found within it though no request ran yet), then the full
        batch, bounded by :data:`PROBE_MARGIN` x the small batch's time extrapolated to
        the full one (:func:`full_probe_bound_s`; at least the floor): a board that
        takes minutes for one batch (software emulation, a Pi under load) is slow, not
        stuck. No answer within a bound is a stall. When a request comes first, the
        probe runs again at the next idle moment."""
        cfg = self.engine.config
        pid = self.engine.pid
        n = max(1, min(cfg.n_batch, cfg.n_ctx_slot - 2))
        small = min(SMALL_BATCH, n)
        self.last_canary_s = self.clock()
        try:
            took_small = await self._probe(
                self._request(small), self.settings.floor_s, f"the step probe ({small} tokens)"
            )
            took = took_small
            if took_small is not None and n > small:
                bound = full_probe_bound_s(self.settings, took_small, small, n)
                took = await self._probe(self._request(n), bound, f"the step probe ({n} tokens)")
                if took is not None:
                    took = max(took, took_small)
        except _Preempted:
            return  # a request came first: it is the proof now; probe when idle again
        self._probed_pid = pid
        if took is not None:
            self.step_s = took
            log.info("liveness: one %d-token batch takes %.3f s here; stall time %.1f s",
                     n, took, self.stall_after_s())  # fmt: skip

    def _request(self, tokens: int) -> tuple[str, dict[str, Any]]:
        return probe_request(self.engine.config.pooling_type, tokens)

    async def _probe(
        self, request: tuple[str, dict[str, Any]], timeout_s: float, what: str
    ) -> float | None:
        """One request of the front's own while idle (a generation, or an embedding or
        a rerank: :func:`probe_request`); its time when it answered 200.
        No answer within ``timeout_s`` is a stall; :class:`_Preempted` when a request
        came first."""
        queue = self.queue
        taken = await queue.acquire(bypass_limit=True)
        try:
            if len(self.flights) or self.engine.state != "ready":
                raise _Preempted
            started = self.clock()
            self._probing = True
            try:
                path, body = request
                status, _, _ = await self.engine.client.request(
                    "POST", path, body, timeout_s=timeout_s
                )
            except EngineUnreachableError as err:
                if self.engine.state == "ready" and self.clock() - started >= timeout_s * 0.9:
                    await self.stalled(f"{what} got no token in {timeout_s:.0f} s",
                                       remember=False)  # fmt: skip
                else:
                    log.info("%s: the engine went away (%s)", what, err)
                return None
            finally:
                self._probing = False
            self.canaries += 1
            if status != 200:
                log.warning("%s answered %d", what, status)
                return None
            self._progressed()
            return self.clock() - started
        finally:
            queue.release(taken)

    # ------------------------------------------------------------ a stall

    async def stalled(self, why: str, *, remember: bool = True) -> None:
        engine = self.engine
        pid = engine.pid
        now = self.clock()
        stuck = min(self.flights, key=lambda f: f.started_s, default=None)
        limit = self.stall_after_s()
        stuck_info = None
        if stuck is not None:
            stuck_info = {"id": stuck.id, "endpoint": stuck.endpoint, "tokens": stuck.tokens,
                          "age_s": round(now - stuck.started_s, 2)}  # fmt: skip
        report: dict[str, Any] = {
            "time": time.time(),
            "why": why,
            "engine_pid": pid,
            "engine_version": engine.version,
            "stall_after_s": round(limit, 2),
            "since_progress_s": round(self.since_progress_s(), 2),
            "in_flight": len(self.flights),
            "stuck_request": stuck_info,
            "threads": [asdict(t) for t in read_thread_states(ROOT, pid)] if pid else [],
            "kernel_stack": read_kernel_stack(ROOT, pid) if pid else None,
            "engine_log_tail": list(engine.tail)[-40:],
        }
        self.last_stall = {k: report[k] for k in ("time", "why", "engine_pid", "stuck_request")}
        path = self._write_evidence(report)
        log.error(
            "engine stalled (pid %s): %s; no progress for %.1f s (limit %.1f s)%s%s; "
            "killing and restarting it",
            pid, why, report["since_progress_s"], limit,
            "" if stuck is None else f", oldest request {report['stuck_request']['age_s']} s old",
            "" if path is None else f"; evidence in {path}",
        )  # fmt: skip
        # Blamed (before anyone can send them again) only on a build without the grammar
        # bound, and only those with a grammar: an ambiguous one wedges the decode loop
        # there and would wedge the next engine too. Not when the front's own probe found
        # it: the requests that came meanwhile waited behind it.
        if remember:
            blamed = self.crashes.stalled(
                [(f.body, f.client, f.grammar) for f in self.flights if f.body is not None]
            )
            if blamed:
                log.warning("%d request(s) with a grammar blamed for the stall (an engine "
                            "build without the grammar bound)", blamed)  # fmt: skip
        self.flights.abort_all(EngineStalledError())
        self.metrics.engine_stalls.inc()
        engine.kill_stalled()
        self.last_progress_s = self.clock()

    def _write_evidence(self, report: dict[str, Any]) -> Path | None:
        if self.state_dir is None:
            return None
        directory = self.state_dir / "stalls"
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            names = sorted((p.name for p in directory.glob("stall-*.json")),
                           key=paths.stall_file_order)  # fmt: skip
            last = paths.stall_file_order(names[-1]) if names else (0, 0, "")
            path = directory / paths.stall_file_name(last[1] + 1, report["engine_pid"])
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(report, f, indent=2)
            for old in names[: max(0, len(names) + 1 - paths.STALLS_KEPT)]:
                (directory / old).unlink(missing_ok=True)  # bounded: the newest are kept
            return path
        except OSError as err:
            log.warning("could not write the stall evidence: %s", err)
            return None
