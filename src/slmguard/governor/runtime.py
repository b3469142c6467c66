"""The governor at run time: sample, decide, act; answer admission and status questions.

Owns the loop that samples :class:`~slmguard.governor.signal.MemorySignal` at
the adaptive interval, feeds :func:`~slmguard.governor.policy.decide`, logs
and counts transitions, and carries out the actions through
:class:`EngineControl`, the small protocol the server implements (it owns the
engine child; the governor never touches processes itself). It is the front's
:class:`~slmguard.governor.request.RequestPolicy` (:meth:`Governor.max_tokens_cap`,
:meth:`Governor.context_verdict`, :meth:`Governor.admit`, each the pure rule of
:mod:`slmguard.governor.policy` on its current state), and it answers the
admin trim and the status route.

Actions run one at a time in a background task so the sampler keeps running
(and admission stays current) while a context is being recreated.

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
from slmguard.governor.events import GovernorCounters
from slmguard.governor.leaks import EngineView, LeakSettings, RecycleEngine, RecycleOutcome
from slmguard.governor.policy import (
    AbortNewest,
    Action,
    Admission,
    Decision,
    DegradeSettings,
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
    decide,
    decide_while_reloading,
    kv_bytes_per_token,
)
from slmguard.governor.policy import max_tokens_cap as policy_cap
from slmguard.governor.recycling import Recycling
from slmguard.governor.request import SizedRequest
from slmguard.governor.signal import (
    DEFAULT_FILL_RATE_BYTES_PER_S,
    DEFAULT_MAX_INTERVAL_S,
    DEFAULT_MIN_INTERVAL_S,
    MemorySignal,
    MemorySnapshot,
    sample_interval_s,
)
from slmguard.host.process import read_status
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


class EngineControl(Protocol):
    """What the governor needs from the server. The server implements it."""

    async def resize_context(self, n_ctx: int) -> None:
        """Recreate the engine's context with ``n_ctx`` tokens; raise SlmguardError on failure."""

    async def abort_newest(self, reason: str) -> bool:
        """Abort the most recently started generation with ``reason``; False if none runs."""

    async def drop_prefix_cache(self) -> None:
        """Forget the engine's cached prompt prefix (its KV cells)."""

    async def park(self, reason: str) -> None:
        """Stop the engine and keep it stopped (running generations end with ``reason``)."""

    async def resume(self, n_ctx: int) -> None:
        """Start the parked engine with ``n_ctx``; return once it serves (EngineError if not)."""

    def engine_pid(self) -> int | None:
        """The engine's pid, None while it is not running."""

    def engine_view(self) -> EngineView | None:
        """The engine's pid, the generations finished and whether it is idle; None while
        it does not serve (the leak check, :mod:`slmguard.governor.recycling`)."""

    async def recycle(self, reason: str, drain_timeout_s: float) -> RecycleOutcome:
        """Stop admitting to the engine, let in-flight generations finish within
        ``drain_timeout_s`` (else ``postponed``, nothing done), restart it, resume."""


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
    # A request arriving when the last sample is older than this triggers a fresh
    # one (a few small file reads), so shedding starts with the first request
    # after a crossing, whatever the sampling interval was.
    admission_max_age_s: float = 0.01

    @classmethod
    def for_model(
        cls, plan: Plan | None, facts: ModelFacts | None, *, kv_type: str
    ) -> GovernorConfig:
        """Thresholds from the plan's watermarks (else the defaults); the memory model from
        the plan's budget, with the KV cost per token from the GGUF header when the plan
        gives none (none at all for a model llama.cpp runs without a KV cache)."""
        if plan is not None:
            thresholds = Thresholds.from_watermarks(plan.watermarks)
            model = MemoryModel.from_plan(plan)
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
        return cls(thresholds=thresholds, model=model)


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
    """The runtime governor. Create it in the server's event loop; see module docstring."""

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
    ) -> None:
        """``slot_tokens`` maps a context of that many KV cells (the governor's unit)
        to the tokens one request may use of it (default: all of them, one slot)."""
        self.signal = signal
        self.config = config
        self.engine = engine
        self.sessions = sessions
        self.slot_tokens = slot_tokens or (lambda n_ctx: n_ctx)
        self.root = root
        self.clock = clock
        self.counters = GovernorCounters()
        self.state = PolicyState.initial(n_ctx_full, clock())
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
        self._actions: asyncio.Queue[Action | RecycleEngine] = asyncio.Queue()
        self._urgent: set[asyncio.Future[None]] = set()  # park actions under way
        self._engine_baseline: tuple[int, int] | None = None  # (pid, private bytes at first sight)
        self._engine_private_bytes: int | None = None
        # The most the engine held so far: what a resume must make room for, even
        # when it was parked while loading (holding little yet).
        self._engine_private_max = 0
        self.recycling = Recycling(
            config.leaks, use_bytes=config.model.use_bytes, root=root, clock=clock
        )

    # ------------------------------------------------------------ sampling and deciding

    def _watch_engine(self) -> None:
        pid = self.engine.engine_pid() if self.engine is not None else None
        if pid is None:
            self._engine_private_bytes = None
            return
        status = read_status(self.root, pid)
        if status is None:  # it exited, or its status is unreadable
            self._engine_private_bytes = None
            return
        private = status.private_bytes
        self._engine_private_bytes = private
        self._engine_private_max = max(self._engine_private_max, private)
        if self._engine_baseline is None or self._engine_baseline[0] != pid:
            self._engine_baseline = (pid, private)

    def extra_bytes(self) -> int:
        """Planned compute-buffer bytes the engine has not made resident yet (>= 0)."""
        use = self.config.model.use_bytes
        if not use or self._engine_baseline is None or self._engine_private_bytes is None:
            return use
        grown = self._engine_private_bytes - self._engine_baseline[1]
        return max(0, use - max(0, grown))

    def tick(self) -> Decision:
        """Sample once and decide (no action is carried out here). Raises HostReadError."""
        snap = self.signal.sample()
        self._watch_engine()
        now = self.clock()
        cfg = self.config
        if self._resizing:
            # While the context is being recreated the old one is already freed
            # and the new one not yet allocated: the dip is not a recovery, and
            # nothing else is shrunk or grown until the reload has settled. Only
            # memory reaching critical acts: the engine is parked at once.
            decision = decide_while_reloading(
                self.state, snap, now, cfg.thresholds, cfg.degrade, cfg.model
            )
            self.interval_s = cfg.min_interval_s
        else:
            decision = decide(self.state, snap, now, cfg.thresholds, cfg.degrade, cfg.model)
        if not cfg.enabled:
            # Report the level the policy would be at, but act on nothing.
            decision = Decision(
                state=replace(decision.state, n_ctx=self.state.n_ctx, parked=False),
                pressure_pct=decision.pressure_pct,
                transitions=decision.transitions,
            )
        old_level = self.state.level
        self.state = decision.state
        self.snapshot = snap
        self.pressure_pct = decision.pressure_pct
        for t in decision.transitions:
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
        for action in decision.actions:
            if isinstance(action, ParkEngine):
                # Not behind a reload the actor may be waiting on: park now.
                self._urgent.add(asyncio.ensure_future(self.execute(action)))
                self._urgent = {t for t in self._urgent if not t.done()}
            else:
                self._actions.put_nowait(action)
        self._check_leaks(snap)
        return decision

    def _check_leaks(self, snap: MemorySnapshot) -> None:
        """The engine's and the front's drift; a recycle queued when it is due (not while
        a context reloads, parked, or with the governor only reporting)."""
        cfg = self.config
        rec = self.recycling
        rec.settings, rec.use_bytes = cfg.leaks, cfg.model.use_bytes
        if self.engine is None or self._resizing or self.state.parked or not cfg.enabled:
            return
        verdict = rec.check(snap, cfg.thresholds.shed_pct, self.engine.engine_view())
        if verdict is not None:
            self._actions.put_nowait(RecycleEngine(verdict))

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

    async def run(self) -> None:
        """Sample and act until :meth:`stop`. Read errors are logged, never fatal."""
        actor = asyncio.create_task(self._act_forever())
        try:
            while not self._stop.is_set():
                try:
                    self.tick()
                except HostReadError as err:
                    events.emit("governor.signal_error", logging.ERROR, error=str(err))
                    self.interval_s = self.config.max_interval_s
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
        """Carry out one action; failures are logged and counted, never raised."""
        try:
            if isinstance(action, RecycleEngine):
                if self.engine is not None:
                    await self.recycling.run(self.engine, action.verdict)
            elif isinstance(action, TrimSessions):
                result = await self.trim(action.keep_recent_tokens)
                self.counters.degrade("trim_sessions")
                events.emit("governor.trim", reason="degrade", **result)
            elif isinstance(action, ResizeContext):
                async with self._engine_reloading():
                    await self._resize(action)
            elif isinstance(action, ParkEngine):
                await self._park(action)
            elif isinstance(action, ResumeEngine):
                async with self._engine_reloading():
                    await self._resume(action)
            elif isinstance(action, AbortNewest):
                aborted = False
                if self.engine is not None:
                    aborted = await self.engine.abort_newest(
                        f"aborted by the memory governor: memory at {action.pressure_pct:.1f}% "
                        "of the limit"
                    )
                if aborted:
                    self.counters.degrade("abort")
                events.emit(
                    "governor.abort",
                    logging.WARNING,
                    aborted=aborted,
                    pressure_pct=round(action.pressure_pct, 2),
                )
        except (SlmguardError, OSError) as err:
            kind = type(action).__name__
            self.counters.fail(kind)
            events.emit("governor.action_failed", logging.ERROR, action=kind, error=str(err))

    @contextlib.asynccontextmanager
    async def _engine_reloading(self) -> AsyncIterator[None]:
        """While the engine loads a context, decide nothing (see :meth:`tick`);
        cooldowns and holds count from when the new context exists."""
        self._resizing = True
        try:
            yield
        finally:
            self._resizing = False
            self.state = replace(self.state, last_resize_s=self.clock())

    async def _resize(self, action: ResizeContext) -> None:
        if self.engine is None:
            return
        before = self._private_now()
        started = self.clock()
        try:
            await self.engine.resize_context(action.n_ctx_to)
        except (SlmguardError, OSError):
            self.last_resize = ResizeRecord(
                action.n_ctx_from,
                action.n_ctx_to,
                action.predicted_delta_bytes,
                None,
                self.clock() - started,
                False,
            )
            self.resizes.append(self.last_resize)
            if self.state.parked:
                # Parked during the reload (memory reached critical): not a failure;
                # the engine comes back at the floor context when memory allows.
                return
            # The context kept its old size: tell the policy so.
            self.state = replace(self.state, n_ctx=action.n_ctx_from)
            raise
        after = self._private_now()
        measured = None if before is None or after is None else before - after
        self.last_resize = ResizeRecord(
            action.n_ctx_from,
            action.n_ctx_to,
            action.predicted_delta_bytes,
            measured,
            self.clock() - started,
            True,
        )
        self.resizes.append(self.last_resize)
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
        )

    async def _park(self, action: ParkEngine) -> None:
        before = self._private_now()
        ws_before = self.snapshot.working_set_bytes if self.snapshot is not None else None
        if self.engine is not None:
            try:
                where = (
                    "no KV cache to shrink"
                    if self.config.model.no_kv_cache
                    else "the context at its floor"
                )
                await self.engine.park(
                    f"the engine was stopped by the memory governor: memory at "
                    f"{action.pressure_pct:.1f}% of the limit with {where}"
                )
            except (SlmguardError, OSError):
                self.state = replace(self.state, parked=False)
                raise
        held = None if before is None else max(before, self._engine_private_max)
        if held is None and ws_before is not None:
            # No engine to measure: count what the working set gave back.
            try:
                held = max(0, ws_before - self.signal.sample().working_set_bytes)
            except HostReadError:
                held = None
        self.state = replace(self.state, parked_bytes=held or 0)
        self.counters.degrade("park")
        events.emit(
            "governor.park",
            logging.WARNING,
            pressure_pct=round(action.pressure_pct, 2),
            n_ctx=action.n_ctx,
            engine_private_bytes=held,
        )

    async def _resume(self, action: ResumeEngine) -> None:
        started = self.clock()
        if self.engine is not None:
            try:
                await self.engine.resume(action.n_ctx)
            except (SlmguardError, OSError):
                # The engine did not come back in time: stop it again so the
                # server and the governor agree, and try after another hold.
                with contextlib.suppress(SlmguardError, OSError):
                    await self.engine.park("the engine did not come back from parking in time")
                self.state = replace(self.state, parked=True, calm_since_s=None)
                raise
        self.counters.degrade("resume")
        events.emit(
            "governor.resume",
            n_ctx=action.n_ctx,
            projected_pct=None if action.projected_pct is None else round(action.projected_pct, 2),
            duration_s=round(self.clock() - started, 3),
        )

    def _private_now(self) -> int | None:
        self._engine_baseline = None  # a resize may replace the engine: re-baseline
        self._watch_engine()
        return self._engine_private_bytes

    # ------------------------------------------------------------ questions from the front

    def admit(self, request: SizedRequest) -> SlmguardError | None:
        """The refusal of a sized request now (``policy.admit``), None to admit it;
        a refusal is counted."""
        cfg = self.config
        snap = self.snapshot
        if not cfg.enabled:
            return None
        if snap is None or self.clock() - snap.taken_s > cfg.admission_max_age_s:
            try:
                self.tick()
            except HostReadError as err:
                events.emit("governor.signal_error", logging.ERROR, error=str(err))
        verdict = admit(
            state=self.state,
            snap=self.snapshot,
            th=cfg.thresholds,
            extra_bytes=self.extra_bytes(),
        )
        return self._refusal(verdict)

    def context_verdict(self, request: SizedRequest) -> SlmguardError | None:
        """A request that does not fit one slot now: 503 while the context is reduced
        and it fits the planned one (``policy.context_verdict``), else None."""
        st = self.state
        verdict = context_verdict(
            request.prompt_tokens,
            request.max_tokens,
            slot_now=self.slot_tokens(st.n_ctx),
            slot_full=self.slot_tokens(st.n_ctx_full),
            th=self.config.thresholds,
        )
        return None if verdict is None else self._refusal(verdict)

    def _refusal(self, verdict: Admission) -> SlmguardError | None:
        if not verdict.admitted:
            self.counters.reject(verdict.code)
        return verdict.error()

    def max_tokens_cap(self) -> int | None:
        """The max_tokens cap in force now (None: no cap)."""
        if not self.config.enabled:
            return None
        return policy_cap(self.state, self.config.degrade)

    async def trim(self, keep_recent_tokens: int, session_id: str | None = None) -> dict[str, Any]:
        """Trim stored histories and drop the engine's cached prefix; returns what was freed."""
        trimmed = NOTHING_TRIMMED
        if self.sessions is not None:
            result = await asyncio.to_thread(
                self.sessions.trim, keep_recent_tokens, session_id=session_id
            )
            trimmed = result.as_dict()
        dropped = False
        if self.engine is not None:
            try:
                await self.engine.drop_prefix_cache()
                dropped = True
            except (SlmguardError, OSError) as err:
                self.counters.fail("drop_prefix_cache")
                events.emit("governor.action_failed", logging.ERROR, action="drop_prefix_cache",
                            error=str(err))  # fmt: skip
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
        """The JSON body of ``GET /api/v1/governor``."""
        cfg, st = self.config, self.state
        snap = self.snapshot
        return {
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
            "leaks": self.recycling.status(),
            "counters": self.counters.snapshot(),
        }
