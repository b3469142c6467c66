"""The governor at run time: sample, decide, act; answer admission and status questions.

Owns the loop that samples :class:`~slmguard.governor.signal.MemorySignal` at the
adaptive interval, feeds :func:`~slmguard.governor.policy.decide` (and heat,
:mod:`slmguard.governor.heat`), logs and counts transitions, and carries out the actions
one at a time in a background task (so sampling and admission stay current) through
:class:`EngineControl`. It is the front's
:class:`~slmguard.governor.request.RequestPolicy` (``max_tokens_cap``,
``context_verdict``, ``admit``: the pure rules of :mod:`slmguard.governor.policy` on its
state; per model on a board, :meth:`Governor.for_model`), answers :meth:`Governor.room_for`
before an on-demand model loads, the admin trim and the status route. Over a board's
engines there is one signal and one level; each step acts on the model
:func:`~slmguard.governor.ladder.decide_board` chooses; each engine's leak check is its
own (:mod:`slmguard.governor.recycling`).

It must not touch processes itself (the server owns the engine child) nor hold a
decision rule of its own (those are pure, in ``policy``, ``thermal`` and ``ladder``).

Example (inside the server's event loop)::

    governor = Governor(MemorySignal(plan_limit_bytes=...), GovernorConfig(),
                        n_ctx_full=2048, engine=control, sessions=store)
    task = asyncio.create_task(governor.run())
    ...
    refusal = governor.admit(SizedRequest("chat", prompt_tokens=900, max_tokens=64))
    ...
    governor.stop(); await task
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from slmguard.errors import HostReadError, SlmguardError
from slmguard.governor import events
from slmguard.governor.board import EngineControl, GovernedModel, Keeping, ModelPolicy
from slmguard.governor.events import GovernorCounters
from slmguard.governor.heat import Heat, HeatSignal
from slmguard.governor.ladder import decide_board
from slmguard.governor.leaks import LeakSettings, RecycleEngine
from slmguard.governor.policy import (
    AbortNewest,
    Action,
    Admission,
    Decision,
    DegradeSettings,
    EvictModel,
    Level,
    MemoryModel,
    ParkEngine,
    PolicyState,
    ResizeContext,
    ResumeEngine,
    Thresholds,
    Transition,
    TrimSessions,
    admit,
    context_verdict,
    kv_bytes_per_token,
)
from slmguard.governor.policy import max_tokens_cap as policy_cap
from slmguard.governor.policy import room_for as policy_room_for
from slmguard.governor.recycling import Recycling
from slmguard.governor.request import RequestPolicy, Room, SizedRequest
from slmguard.governor.signal import (
    DEFAULT_FILL_RATE_BYTES_PER_S,
    DEFAULT_MAX_INTERVAL_S,
    DEFAULT_MIN_INTERVAL_S,
    MemorySignal,
    MemorySnapshot,
    sample_interval_s,
)
from slmguard.governor.thermal import HeatSettings, slots_allowed
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.schema import Plan

log = logging.getLogger(__name__)


class TrimCounts(Protocol):
    def as_dict(self) -> dict[str, int]:
        """sessions_seen, sessions_trimmed, messages_removed, tokens_removed, tokens_kept."""


class SessionTrim(Protocol):
    """What the governor needs of the server's session store
    (:class:`slmguard.serve.sessions.SessionStore`)."""

    def trim(self, keep_recent_tokens: int, *, session_id: str | None = None) -> TrimCounts:
        """Trim one session (or all) to its most recent tokens (a blocking call)."""

    def sessions(self) -> list[str]:
        """The stored session ids."""


#: What a trim reports without a session store.
NOTHING_TRIMMED = dict.fromkeys(
    ("sessions_seen", "sessions_trimmed", "messages_removed", "tokens_removed", "tokens_kept"), 0
)


__all__ = ["EngineControl", "Governor", "GovernorConfig", "Keeping"]  # EngineControl: board's


@dataclass(frozen=True)
class GovernorConfig:
    """The governor's settings; every field has a working default.

    Example::

        GovernorConfig(thresholds=Thresholds.from_watermarks(plan.watermarks),
                       model=MemoryModel.from_plan(plan))
    """

    thresholds: Thresholds = field(default_factory=Thresholds)
    degrade: DegradeSettings = field(default_factory=DegradeSettings)
    model: MemoryModel = field(default_factory=MemoryModel)
    leaks: LeakSettings = field(default_factory=LeakSettings)  # leak-aware recycling
    fill_rate_bytes_per_s: float = DEFAULT_FILL_RATE_BYTES_PER_S
    min_interval_s: float = DEFAULT_MIN_INTERVAL_S
    max_interval_s: float = DEFAULT_MAX_INTERVAL_S
    enabled: bool = True  # False: sample and report, never shed, degrade or abort
    heat: HeatSettings = field(default_factory=HeatSettings)
    thermal_zones: tuple[str, ...] = ()  # the plan's board.thermal_zones (empty: all with a limit)
    # A request arriving when the last sample is older than this triggers a fresh
    # one (a few small file reads), so shedding starts with the first request
    # after a crossing, whatever the sampling interval was.
    admission_max_age_s: float = 0.01
    # The memory model of each further model of a board, by name (the primary's is
    # ``model``); a model without one is shrunk blind (no KV bytes to predict with).
    models: dict[str, MemoryModel] = field(default_factory=dict)
    # The plan's sets of models that may be resident together, by served name (none: an
    # on-demand load is decided by memory alone).
    resident_sets: tuple[frozenset[str], ...] = ()

    @classmethod
    def for_model(
        cls, plan: Plan | None, facts: ModelFacts | None, *, kv_type: str
    ) -> GovernorConfig:
        """Thresholds from the plan's watermarks (else the defaults); the memory model from
        the plan's budget, with the KV cost per token from the GGUF header when the plan
        gives none (none at all for a model llama.cpp runs without a KV cache)."""
        zones: tuple[str, ...] = ()
        if plan is not None:
            thresholds = Thresholds.from_watermarks(plan.watermarks)
            model = MemoryModel.from_plan(plan)
            zones = tuple(plan.board.thermal_zones)
        else:
            thresholds = Thresholds()
            model = MemoryModel()
        if facts is not None and not facts.has_kv_cache:
            model = MemoryModel(kv_bytes_per_token=0, use_bytes=model.use_bytes, no_kv_cache=True)
        elif model.kv_bytes_per_token == 0 and not model.no_kv_cache and facts is not None:
            per_token = kv_bytes_per_token(
                facts.n_layer, facts.n_head_kv, facts.key_length, facts.value_length, kv_type
            )
            model = MemoryModel(kv_bytes_per_token=per_token, use_bytes=model.use_bytes)
        return cls(thresholds=thresholds, model=model, thermal_zones=zones)


@dataclass(frozen=True)
class ResizeRecord:
    """One context resize as carried out, for status and the benchmark."""

    n_ctx_from: int
    n_ctx_to: int
    predicted_delta_bytes: int
    measured_delta_bytes: int | None  # engine private RSS before - after (None: no pid)
    duration_s: float
    ok: bool


class Governor:
    """The runtime governor. Create it in the server's event loop; see module docstring.

    The engine given here is the primary model's (``name``); a board's further models
    are added with :meth:`add_model`. :attr:`engine` and :attr:`state` are the
    primary's.
    """

    def __init__(
        self,
        signal: MemorySignal,
        config: GovernorConfig,
        n_ctx_full: int,
        *,
        engine: EngineControl | None = None,
        sessions: SessionTrim | None = None,
        slot_tokens: Callable[[int], int] | None = None,
        root: Path = Path("/"),
        clock: Callable[[], float] = time.monotonic,
        name: str = "model",
        keeping: Keeping | None = None,
    ) -> None:
        """``slot_tokens`` maps a context of that many KV cells (the governor's unit)
        to the tokens one request may use of it (default: all of them, one slot)."""
        self.signal = signal
        self.config = config
        self.sessions = sessions
        self.root = root
        self.clock = clock
        self.counters = GovernorCounters()
        primary = GovernedModel(name, engine, PolicyState.initial(n_ctx_full, clock()),
                                slot_tokens=slot_tokens, keeping=keeping,
                                recycling=self._recycling(config.model))  # fmt: skip
        self.models: list[GovernedModel] = [primary]
        # Heat (issue 41): the plan's thermal zones under the same root, a rule of its own
        # for the whole board (one SoC): its slots limit every engine, its cap and
        # shedding every model's requests.
        self.heat = Heat(
            HeatSignal(root, config.thermal_zones, clock=clock), config.heat,
            planned_slots=self._planned_slots, counters=self.counters, clock=clock,
        )  # fmt: skip
        self.snapshot: MemorySnapshot | None = None
        self.pressure_pct = 0.0
        self.interval_s = config.max_interval_s
        self.last_resize: ResizeRecord | None = None
        self.resizes: collections.deque[ResizeRecord] = collections.deque(maxlen=16)
        # The latest level changes, for GET /api/v1/governor (slmguard top's events pane).
        self.transitions: collections.deque[dict[str, Any]] = collections.deque(maxlen=32)
        # Why the server is degraded while the level sheds or worse (/health says so).
        self.degraded_reason: str | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._resizing = False
        self._signal_error: str | None = None  # the last read error, said once
        self._actions: asyncio.Queue[Action | RecycleEngine] = asyncio.Queue()
        self._urgent: set[asyncio.Future[None]] = set()  # park actions under way

    def add_model(
        self,
        name: str,
        control: EngineControl,
        n_ctx_full: int,
        *,
        memory: MemoryModel,
        slot_tokens: Callable[[int], int] | None = None,
        keeping: Keeping | None = None,
    ) -> None:
        """Drive one more engine (a further model of a board), at the current level."""
        if any(m.name == name for m in self.models):
            raise ValueError(f"the governor already drives a model named {name!r}")
        shared = {k: getattr(self.state, k) for k in ("level", "level_since_s")}
        state = replace(PolicyState.initial(n_ctx_full, self.clock()), **shared)
        recycling = self._recycling(memory, front=False)  # the front is the primary's to watch
        self.models.append(GovernedModel(name, control, state, memory=memory,
                                         slot_tokens=slot_tokens, keeping=keeping,
                                         recycling=recycling))  # fmt: skip

    def _recycling(self, memory: MemoryModel, *, front: bool = True) -> Recycling:
        """One engine's leak check (each engine of a board has its own)."""
        return Recycling(self.config.leaks, use_bytes=memory.use_bytes, root=self.root,
                         clock=self.clock, watch_front=front)  # fmt: skip

    # ------------------------------------------------------------ the primary, and each model

    @property
    def primary(self) -> GovernedModel:
        return self.models[0]

    @property
    def engine(self) -> EngineControl | None:
        return self.primary.control

    @engine.setter
    def engine(self, control: EngineControl | None) -> None:
        self.primary.control = control

    @property
    def state(self) -> PolicyState:
        return self.primary.state

    @state.setter
    def state(self, state: PolicyState) -> None:
        self.primary.state = state

    @property
    def recycling(self) -> Recycling:
        """The primary engine's leak check (each model's is ``GovernedModel.recycling``)."""
        return self.primary.recycling

    @property
    def slot_tokens(self) -> Callable[[int], int]:
        return self.primary.slot_tokens

    def model(self, name: str | None) -> GovernedModel:
        """The model ``name`` (None: the primary)."""
        if name is None:
            return self.primary
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(f"the governor drives no model named {name!r}")

    def memory(self, m: GovernedModel) -> MemoryModel:
        return m.memory if m.memory is not None else self.config.model

    def for_model(self, name: str) -> RequestPolicy:
        """The request policy of the model ``name``: the governor itself for the only one."""
        m = self.model(name)
        if len(self.models) == 1:
            return self
        return ModelPolicy(self, m)

    # ------------------------------------------------------------ sampling and deciding

    def extra_bytes(self, m: GovernedModel | None = None) -> int:
        """Planned compute-buffer bytes the engine has not made resident yet (>= 0)."""
        m = m or self.primary
        return m.extra_bytes(self.memory(m).use_bytes)

    def tick(self) -> Decision:
        """Sample once and decide (no action is carried out here). Raises HostReadError.

        While a context is being recreated the old one is already freed and the new one
        not yet allocated: the dip is not a recovery, and nothing else is shrunk or grown
        until the reload has settled. Only memory reaching critical acts: an engine is
        parked at once."""
        snap = self.signal.sample()
        for m in self.models:
            m.watch(self.root)
        now = self.clock()
        cfg = self.config
        several = len(self.models) > 1
        rungs = [m.rung(self.memory(m), several=several) for m in self.models]
        board = decide_board(rungs, snap, now, cfg.thresholds, cfg.degrade,
                             reloading=self._resizing)  # fmt: skip
        if self._resizing:
            self.interval_s = cfg.min_interval_s
        states, actions = board.states, board.actions
        if not cfg.enabled:
            # Report the level the policy would be at, but act on nothing.
            states = tuple(replace(new, n_ctx=m.state.n_ctx, parked=False)
                           for new, m in zip(states, self.models, strict=True))  # fmt: skip
            actions = ()
        old_level = self.state.level
        for m, state in zip(self.models, states, strict=True):
            m.state = state
        self.snapshot = snap
        self.pressure_pct = board.pressure_pct
        for t in board.transitions:
            self._record_transition(t, snap)
        if cfg.enabled and self.state.level >= Level.DEGRADE > old_level:
            self.counters.degrade("max_tokens_cap")
        th = cfg.thresholds
        if not self._resizing:
            self.interval_s = sample_interval_s(
                snap,
                (th.recover_pct, th.shed_pct, th.degrade_pct, th.critical_pct),
                fill_rate_bytes_per_s=cfg.fill_rate_bytes_per_s,
                min_s=cfg.min_interval_s,
                max_s=cfg.max_interval_s,
            )
        for action in actions:
            if isinstance(action, ParkEngine):
                # Not behind a reload the actor may be waiting on: park now.
                self._urgent.add(asyncio.ensure_future(self.execute(action)))
                self._urgent = {t for t in self._urgent if not t.done()}
            else:
                self._actions.put_nowait(action)
        decision = Decision(self.state, board.pressure_pct, board.transitions, actions)
        self._check_leaks(snap)
        return decision

    def _planned_slots(self) -> int:
        return self.engine.planned_slots() if self.engine is not None else 1

    def heat_tick(self) -> None:
        """Heat's step, when its interval is up: the slots the new level admits, on every
        engine of a board (one SoC heats them all), each out of its own planned slots."""
        for step in self.heat.tick():
            if not self.config.enabled:
                continue
            for m in self.models:
                if m.control is None:
                    continue
                planned = m.control.planned_slots()
                slots = slots_allowed(step.to_level, planned)
                m.control.limit_slots(None if slots >= planned else slots)

    def _check_leaks(self, snap: MemorySnapshot) -> None:
        """Each engine's drift (and the front's, with the primary's); a recycle of that
        engine queued when it is due (not while a context reloads, parked, or with the
        governor only reporting)."""
        cfg = self.config
        for m in self.models:
            rec = m.recycling
            rec.settings, rec.use_bytes = cfg.leaks, self.memory(m).use_bytes
            if m.control is None or self._resizing or m.state.parked or not cfg.enabled:
                continue
            verdict = rec.check(snap, cfg.thresholds.shed_pct, m.control.engine_view())
            if verdict is not None:
                model = None if m is self.primary else m.name
                self._actions.put_nowait(RecycleEngine(verdict, model=model))

    def _record_transition(self, t: Transition, snap: MemorySnapshot) -> None:
        """Count a level change, keep it for the status route, say whether the server is
        degraded, log it."""
        self.counters.transition(t.from_level.label, t.to_level.label)
        self.transitions.append(
            {
                "from_level": t.from_level.label,
                "to_level": t.to_level.label,
                "reason": t.reason,
                "pressure_pct": round(t.pressure_pct, 2),
                "at_unix_s": round(time.time(), 3),
            }
        )
        self.degraded_reason = None
        if t.to_level >= Level.SHED:
            self.degraded_reason = (
                f"memory governor at {t.to_level.label}: {t.pressure_pct:.1f}% of "
                f"{snap.limit_bytes} bytes ({snap.limit_source})"
            )
        events.emit(
            "governor.transition",
            logging.WARNING if t.to_level > t.from_level else logging.INFO,
            from_level=t.from_level.label,
            to_level=t.to_level.label,
            reason=t.reason,
            pressure_pct=round(t.pressure_pct, 2),
            working_set_bytes=snap.working_set_bytes,
            limit_bytes=snap.limit_bytes,
            limit_source=snap.limit_source,
            psi_some_avg10_pct=snap.psi_some_avg10_pct,
            n_ctx=self.state.n_ctx,
        )

    def _signal_failed(self, err: HostReadError) -> None:
        """A sample that could not be read: said once (until it reads again or the error
        changes), with what the governor does meanwhile; repeats at DEBUG."""
        error = str(err)
        again = error == self._signal_error
        self._signal_error = error
        events.emit(
            "governor.signal_error",
            logging.DEBUG if again else logging.ERROR,
            error=error,
            meanwhile=f"the governor stays at {self.state.level.label} and samples again "
            f"every {self.config.max_interval_s:g} s; said once until it reads again",
        )
        self.interval_s = self.config.max_interval_s

    def _signal_read(self) -> None:
        if self._signal_error is not None:
            events.emit("governor.signal_recovered", logging.INFO, error=self._signal_error)
            self._signal_error = None

    async def run(self) -> None:
        """Sample and act until :meth:`stop`. Read errors are logged, never fatal."""
        actor = asyncio.create_task(self._act_forever())
        try:
            while not self._stop.is_set():
                try:
                    self.tick()
                except HostReadError as err:
                    self._signal_failed(err)
                else:
                    self._signal_read()
                self.heat_tick()
                with contextlib.suppress(asyncio.exceptions.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval_s)
        finally:
            actor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await actor

    def stop(self) -> None:
        self._stop.set()

    def start(self) -> asyncio.Task[None]:
        """Run the loop as a task of the running event loop (the server's)."""
        self._task = asyncio.create_task(self.run(), name="memory-governor")
        return self._task

    async def aclose(self) -> None:
        """Stop the loop and wait for it (the session store is the server's to close)."""
        self.stop()
        if self._task is not None:
            await self._task
            self._task = None

    # ------------------------------------------------------------ actions

    async def _act_forever(self) -> None:
        while True:
            action = await self._actions.get()
            await self.execute(action)

    async def execute(self, action: Action | RecycleEngine) -> None:
        """Carry out one action on the model it names; failures are logged and counted,
        never raised."""
        try:
            if isinstance(action, TrimSessions):
                result = await self.trim(action.keep_recent_tokens)
                self.counters.degrade("trim_sessions")
                events.emit("governor.trim", reason="degrade", **result)
                return
            m = self.model(action.model)
            if isinstance(action, RecycleEngine):
                if m.control is not None:
                    await m.recycling.run(m.control, action.verdict)
            elif isinstance(action, ResizeContext):
                async with self._engine_reloading():
                    await self._resize(action, m)
            elif isinstance(action, ParkEngine):
                await self._park(action, m)
            elif isinstance(action, ResumeEngine):
                async with self._engine_reloading():
                    await self._resume(action, m)
            elif isinstance(action, AbortNewest):
                await self._abort(action, m)
            elif isinstance(action, EvictModel):
                await self._evict(action, m)
        except (SlmguardError, OSError) as err:
            kind = type(action).__name__
            self.counters.fail(kind)
            events.emit("governor.action_failed", logging.ERROR, action=kind, error=str(err))

    @contextlib.asynccontextmanager
    async def _engine_reloading(self) -> AsyncIterator[None]:
        """While an engine loads a context, decide nothing (see :meth:`tick`);
        cooldowns and holds count from when the new context exists."""
        self._resizing = True
        try:
            yield
        finally:
            self._resizing = False
            now = self.clock()
            for m in self.models:
                m.state = replace(m.state, last_resize_s=now)

    def _named(self, m: GovernedModel) -> dict[str, Any]:
        """The model an event is about (said only when there are several)."""
        return {"model": m.name} if len(self.models) > 1 else {}

    async def _abort(self, action: AbortNewest, m: GovernedModel) -> None:
        aborted = False
        if m.control is not None:
            aborted = await m.control.abort_newest(
                f"aborted by the memory governor: memory at {action.pressure_pct:.1f}% of the limit"
            )
        if aborted:
            self.counters.degrade("abort")
        events.emit("governor.abort", logging.WARNING, aborted=aborted,
                    pressure_pct=round(action.pressure_pct, 2), **self._named(m))  # fmt: skip

    async def _evict(self, action: EvictModel, m: GovernedModel) -> None:
        """Unload an idle on-demand model (not when it became busy meanwhile)."""
        before = m.private_bytes
        evict = m.keeping.evict
        reason = (f"evicted by the memory governor: memory at {action.pressure_pct:.1f}% of "
                  "the limit")  # fmt: skip
        evicted = evict is not None and await evict(reason)
        if evicted:
            self.counters.degrade("evict")
        events.emit("governor.evict", logging.WARNING, model=m.name, evicted=evicted,
                    engine_private_bytes=before,
                    pressure_pct=round(action.pressure_pct, 2))  # fmt: skip

    async def _resize(self, action: ResizeContext, m: GovernedModel) -> None:
        if m.control is None:
            return
        before = self._private_now(m)
        started = self.clock()
        try:
            await m.control.resize_context(action.n_ctx_to)
        except (SlmguardError, OSError):
            self._record_resize(action, None, started, ok=False)
            if m.state.parked:
                # Parked during the reload (memory reached critical): not a failure;
                # the engine comes back at the floor context when memory allows.
                return
            # The context kept its old size: tell the policy so.
            m.state = replace(m.state, n_ctx=action.n_ctx_from)
            raise
        after = self._private_now(m)
        measured = None if before is None or after is None else before - after
        self._record_resize(action, measured, started, ok=True)
        self.counters.degrade(f"context_{action.kind}")
        if action.kind == "shrink" and measured is not None:
            self.counters.freed(measured, action.predicted_delta_bytes)
        events.emit(
            f"governor.context_{action.kind}",
            logging.WARNING if action.kind == "shrink" else logging.INFO,
            n_ctx_from=action.n_ctx_from,
            n_ctx_to=action.n_ctx_to,
            predicted_delta_bytes=action.predicted_delta_bytes,
            measured_delta_bytes=measured,
            duration_s=round(self.clock() - started, 3),
            **self._named(m),
        )

    def _record_resize(
        self, action: ResizeContext, measured: int | None, started: float, *, ok: bool
    ) -> None:
        self.last_resize = ResizeRecord(
            action.n_ctx_from, action.n_ctx_to, action.predicted_delta_bytes, measured,
            self.clock() - started, ok,
        )  # fmt: skip
        self.resizes.append(self.last_resize)

    async def _park(self, action: ParkEngine, m: GovernedModel) -> None:
        before = self._private_now(m)
        ws_before = self.snapshot.working_set_bytes if self.snapshot is not None else None
        if m.control is not None:
            try:
                where = (
                    "no KV cache to shrink"
                    if self.memory(m).no_kv_cache
                    else "the context at its floor"
                )
                await m.control.park(
                    f"the engine was stopped by the memory governor: memory at "
                    f"{action.pressure_pct:.1f}% of the limit with {where}"
                )
            except (SlmguardError, OSError):
                m.state = replace(m.state, parked=False)
                raise
        held = None if before is None else max(before, m.private_max)
        if held is None and ws_before is not None:
            # No engine to measure: count what the working set gave back.
            try:
                held = max(0, ws_before - self.signal.sample().working_set_bytes)
            except HostReadError:
                held = None
        m.state = replace(m.state, parked_bytes=held or 0)
        self.counters.degrade("park")
        events.emit(
            "governor.park",
            logging.WARNING,
            pressure_pct=round(action.pressure_pct, 2),
            n_ctx=action.n_ctx,
            engine_private_bytes=held,
            **self._named(m),
        )

    async def _resume(self, action: ResumeEngine, m: GovernedModel) -> None:
        started = self.clock()
        if m.control is not None:
            try:
                await m.control.resume(action.n_ctx)
            except (SlmguardError, OSError):
                # The engine did not come back in time: stop it again so the
                # server and the governor agree, and try after another hold.
                with contextlib.suppress(SlmguardError, OSError):
                    await m.control.park("the engine did not come back from parking in time")
                m.state = replace(m.state, parked=True)
                for each in self.models:
                    each.state = replace(each.state, calm_since_s=None)
                raise
        self.counters.degrade("resume")
        events.emit(
            "governor.resume",
            n_ctx=action.n_ctx,
            projected_pct=None if action.projected_pct is None else round(action.projected_pct, 2),
            duration_s=round(self.clock() - started, 3),
            **self._named(m),
        )

    def _private_now(self, m: GovernedModel) -> int | None:
        m.baseline = None  # a resize may replace the engine: re-baseline
        m.watch(self.root)
        return m.private_bytes

    # ------------------------------------------------------------ questions from the front

    def _fresh(self) -> None:
        """A new sample when the last one is older than ``admission_max_age_s``."""
        snap = self.snapshot
        if snap is None or self.clock() - snap.taken_s > self.config.admission_max_age_s:
            try:
                self.tick()
            except HostReadError as err:
                events.emit("governor.signal_error", logging.ERROR, error=str(err))

    def admit(self, request: SizedRequest, m: GovernedModel | None = None) -> SlmguardError | None:
        """The refusal of a sized request for model ``m`` (None: the primary) now
        (``policy.admit``), None to admit it; a refusal is counted."""
        cfg = self.config
        if not cfg.enabled:
            return None
        self._fresh()
        m = m or self.primary
        verdict = admit(
            state=m.state,
            snap=self.snapshot,
            th=cfg.thresholds,
            extra_bytes=self.extra_bytes(m) + request.transient_bytes,  # its images
        )
        if verdict.admitted:
            verdict = self.heat.admission() or verdict  # new work is shed last, for heat
        return self._refusal(verdict)

    def context_verdict(
        self, request: SizedRequest, m: GovernedModel | None = None
    ) -> SlmguardError | None:
        """A request that does not fit one slot now: 503 while the context is reduced
        and it fits the planned one (``policy.context_verdict``), else None."""
        m = m or self.primary
        st = m.state
        verdict = context_verdict(
            request.prompt_tokens,
            request.max_tokens,
            slot_now=m.slot_tokens(st.n_ctx),
            slot_full=m.slot_tokens(st.n_ctx_full),
            th=self.config.thresholds,
        )
        return None if verdict is None else self._refusal(verdict)

    def _refusal(self, verdict: Admission) -> SlmguardError | None:
        if not verdict.admitted:
            self.counters.reject(verdict.code)
        return verdict.error()

    def max_tokens_cap(self, m: GovernedModel | None = None) -> int | None:
        """The max_tokens cap in force now for model ``m`` (None: no cap)."""
        if not self.config.enabled:
            return None
        caps = (policy_cap((m or self.primary).state, self.config.degrade),
                self.heat.max_tokens_cap())  # fmt: skip
        known = [c for c in caps if c is not None]
        return min(known) if known else None

    def room_for(self, name: str) -> Room:
        """Whether the on-demand model ``name`` may load now and which idle on-demand
        models to evict first, lowest priority first (``policy.room_for``); a refusal
        is counted. Busy models are never offered for eviction."""
        if not self.config.enabled:
            return Room()
        self._fresh()
        m = self.model(name)
        order = sorted(range(len(self.models)),
                       key=lambda i: (self.models[i].keeping.priority, -i))  # fmt: skip
        evictable = [
            (o.name, o.held_bytes())
            for o in (self.models[i] for i in order)
            if o is not m and o.keeping.on_demand and o.keeping.evict is not None
            and o.keeping.resident() and not o.keeping.busy() and not o.state.parked
        ]  # fmt: skip
        resident = [o.name for o in self.models if o.keeping.resident() or o is m]
        evict, verdict = policy_room_for(
            name, m.need_bytes(), evictable, state=m.state, snap=self.snapshot,
            th=self.config.thresholds, resident=resident, sets=self.config.resident_sets,
        )  # fmt: skip
        return Room(evict, self._refusal(verdict))

    async def trim(self, keep_recent_tokens: int, session_id: str | None = None) -> dict[str, Any]:
        """Trim stored histories and drop the engines' cached prefixes (those in memory);
        returns what was freed."""
        trimmed = NOTHING_TRIMMED
        if self.sessions is not None:
            result = await asyncio.to_thread(
                self.sessions.trim, keep_recent_tokens, session_id=session_id
            )
            trimmed = result.as_dict()
        dropped = False
        for m in self.models:
            if m.control is None or (m is not self.primary and not m.keeping.resident()):
                continue
            try:
                await m.control.drop_prefix_cache()
                dropped = True
            except (SlmguardError, OSError) as err:
                self.counters.fail("drop_prefix_cache")
                events.emit("governor.action_failed", logging.ERROR, action="drop_prefix_cache",
                            error=str(err), **self._named(m))  # fmt: skip
        return {**trimmed, "prefix_cache_dropped": dropped}

    def summary(self) -> dict[str, Any]:
        """The governor's part of the server's /health: level, pressure and context."""
        st = self.state
        return {
            "level": st.level.label,
            "pressure_pct": round(self.pressure_pct, 2),
            "n_ctx": st.n_ctx,
            "n_ctx_full": st.n_ctx_full,
            "recycle": self.recycling.summary(),
        }

    def status(self) -> dict[str, Any]:
        """The JSON body of ``GET /api/v1/governor``; the primary's context at the top,
        every model's in ``models`` on a board."""
        cfg, st = self.config, self.state
        snap = self.snapshot
        status = {
            "enabled": cfg.enabled,
            "level": st.level.label,
            "level_for_s": round(self.clock() - st.level_since_s, 3),
            "pressure_pct": round(self.pressure_pct, 2),
            "signal": snap.as_dict() if snap is not None else None,
            # The plan's allowance for device memory outside the cgroup (0: none counted
            # apart: no offload, or a driver that charges the cgroup, lavapipe among them).
            "device_allowance_bytes": self.signal.device_bytes,
            "thresholds": cfg.thresholds.as_dict(),
            "n_ctx": st.n_ctx,
            "n_ctx_full": st.n_ctx_full,
            "parked": st.parked,
            "parked_bytes": st.parked_bytes if st.parked else None,
            "n_ctx_floor": min(cfg.degrade.n_ctx_floor, st.n_ctx_full),
            "max_tokens_cap": self.max_tokens_cap(),
            "keep_recent_tokens": cfg.degrade.keep_recent_tokens,
            "sample_interval_s": round(self.interval_s, 4),
            "kv_bytes_per_token": cfg.model.kv_bytes_per_token,
            "kv_cache": not cfg.model.no_kv_cache,
            "last_resize": None if self.last_resize is None else asdict(self.last_resize),
            "resizes": [asdict(r) for r in self.resizes],
            "transitions": list(self.transitions),
            "thermal": self.heat.status(),
            "leaks": self.recycling.status(),
            "counters": self.counters.snapshot(),
        }
        if len(self.models) > 1:
            status["models"] = [self._model_status(m) for m in self.models]
        return status

    def _model_status(self, m: GovernedModel) -> dict[str, Any]:
        """One model of a board as the governor sees it."""
        st, k, memory = m.state, m.keeping, self.memory(m)
        return {
            "model": m.name,
            "priority": k.priority,
            "residency": "on_demand" if k.on_demand else "pinned",
            "resident": k.resident(),
            "busy": k.busy(),
            "n_ctx": st.n_ctx,
            "n_ctx_full": st.n_ctx_full,
            "n_ctx_floor": min(self.config.degrade.n_ctx_floor, st.n_ctx_full),
            "parked": st.parked,
            "parked_bytes": st.parked_bytes if st.parked else None,
            "max_tokens_cap": self.max_tokens_cap(m),
            "kv_bytes_per_token": memory.kv_bytes_per_token,
            "kv_cache": not memory.no_kv_cache,
            "engine_private_bytes": m.private_bytes,
            "planned_bytes": k.planned_bytes,
            "recycle": m.recycling.summary(),
        }
