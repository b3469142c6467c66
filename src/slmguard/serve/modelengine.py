"""One served model and everything that serves it: the per-engine parts of a server.

Owns :class:`ModelEngine`: for one model, its supervised llama-server child
(:class:`~slmguard.serve.engine.EngineProcess`: start, restart with its own budget,
reconfigure, park) with its slot queue, requests in flight, cached slots, crash memory,
liveness check, request bounds, the governor's control over it
(:class:`~slmguard.serve.control.GovernedEngine`), its metrics' series, and, once
given the request policy (:meth:`ModelEngine.bind`), its sizing, relay and the
dialects' context. A server of one model holds one; a board's server one per model
(:mod:`slmguard.serve.models`), each supervised alone: a change that applies to one
engine (a restart, a resize, a recycle) is made here, per model. It decides neither
memory (the governor's) nor routing (the table's) nor when an on-demand model loads
(:mod:`slmguard.serve.residency`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slmguard.governor.request import RequestPolicy
from slmguard.serve.blame import CrashMemory
from slmguard.serve.bounds import Bounds, Limits
from slmguard.serve.control import GovernedEngine
from slmguard.serve.dialects.context import DialectContext
from slmguard.serve.engine import EngineProcess, RestartPolicy
from slmguard.serve.flights import Flights
from slmguard.serve.liveness import Liveness, LivenessSettings
from slmguard.serve.llamaserver import EngineConfig
from slmguard.serve.metrics import ModelMetrics, ServeMetrics
from slmguard.serve.queue import SlotQueue
from slmguard.serve.readiness import RetryAfter
from slmguard.serve.relay import Relay
from slmguard.serve.served import ServedModel
from slmguard.serve.sessions import SessionService
from slmguard.serve.sizing import Sizing, TokenLimits
from slmguard.serve.slots import SlotsView
from slmguard.serve.vision import ServedVision
from slmguard.settings import ServeSettings, default_max_tokens

#: How a model stays in memory: loaded at start and kept (``pinned``), or loaded when a
#: request needs it and unloaded when idle or evicted (``on_demand``).
RESIDENCIES = ("pinned", "on_demand")


@dataclass(frozen=True)
class Residency:
    """How one model is kept: ``residency`` (pinned | on_demand), its ``priority`` (the
    governor's ladder and eviction act on the lowest first), ``idle_unload_s`` (an idle
    on-demand model is unloaded after it; 0: never) and ``planned_bytes`` (what its plan
    says it makes resident at its peak: what loading it must find room for)."""

    residency: str = "pinned"
    priority: int = 100
    idle_unload_s: float = 0.0
    planned_bytes: int = 0

    def __post_init__(self) -> None:
        if self.residency not in RESIDENCIES:
            raise ValueError(f"residency must be one of {RESIDENCIES}, got {self.residency!r}")

    @property
    def on_demand(self) -> bool:
        return self.residency == "on_demand"


@dataclass(frozen=True)
class ServedEngine:
    """What one model's engine is built from: the model as served, the engine's whole
    settings, how it is kept, and what its engine adds to the environment."""

    model: ServedModel
    config: EngineConfig
    residency: Residency
    environ: dict[str, str] | None = None
    vision: ServedVision | None = None  # its projector (serve --mmproj), images served


@dataclass(frozen=True)
class EngineHome:
    """Where one engine runs from: its binary and version, its private runtime directory
    (socket, key, slot files), the state directory and the environment it adds."""

    binary: Path
    version: str
    runtime_dir: Path
    state_dir: Path
    environ: dict[str, str] | None = None


class ModelEngine:
    """One model's engine and its parts (see the module docstring).

    ``log_name`` (a server of several models) names its engine's loggers for the model.
    ``on_state(model_engine, state)`` is called after each of its engine's state
    changes (its metrics and queue already follow), ``on_failed(model_engine)`` once
    its restart budget is spent or its model cannot be loaded.
    """

    def __init__(
        self,
        settings: ServeSettings,
        model: ServedModel,
        config: EngineConfig,
        home: EngineHome,
        *,
        metrics: ServeMetrics,
        sessions: SessionService | None,
        residency: Residency | None = None,
        vision: ServedVision | None = None,
        grammar_bound: bool = True,
        log_name: str | None = None,
        on_state: Callable[[ModelEngine, str], None] | None = None,
        on_failed: Callable[[ModelEngine], None] | None = None,
    ) -> None:
        s = settings
        self.settings = settings
        self.model = model
        self.residency = residency or Residency()
        self.vision = vision
        self.sessions = sessions
        self.queue = SlotQueue(config.n_parallel, s.queue_size)
        self.flights = Flights()
        self.grammar_bound = grammar_bound  # the engine stops a grammar past its work bound
        self.crashes = CrashMemory()  # the engine's crashes, its grammar refusals, their clients
        self.crashes.grammar_bound = grammar_bound
        self._on_state = on_state
        self._on_failed = on_failed
        self.users = 0  # requests between their route and their relay (not yet in flight)
        self.last_used_s = time.monotonic()
        restart = RestartPolicy(
            backoff_initial_s=s.restart_backoff_initial_s,
            backoff_max_s=s.restart_backoff_max_s,
            max_restarts=s.restart_max,
            window_s=s.restart_window_s,
        )
        self.engine = EngineProcess(
            home.binary, config, restart, alias=model.id, runtime_dir=home.runtime_dir,
            version=home.version, oom_score_adj=s.engine_oom_score_adj,
            load_timeout_s=s.engine_load_timeout_s, on_state=self._engine_state,
            on_restart=self._engine_restarted, on_failed=self._engine_failed,
            on_exit=self.crashes.settle, env=home.environ, log_name=log_name,
        )  # fmt: skip
        self.slots = SlotsView(self.engine)
        self.metrics: ModelMetrics = metrics.add_model(model.id, self.queue, self.engine,
                                                       self.slots)  # fmt: skip
        self._unloaded = self.residency.on_demand  # an on-demand model starts unloaded
        self.control = GovernedEngine(self.engine, self.queue, self.flights, self.slots,
                                      busy=self.busy, evict=self.evict)  # fmt: skip
        self.bounds = Bounds(
            Limits.of(s, n_ctx_slot=config.n_ctx_slot, n_vocab=model.n_vocab),
            simulate_stacks=not grammar_bound,
        )
        liveness = LivenessSettings(
            floor_s=s.stall_floor_s,
            factor=s.stall_factor,
            fixed_s=s.stall_timeout_s,
            canary_interval_s=s.canary_interval_s,
        )
        self.liveness = Liveness(
            self.engine, self.flights, self.queue, self.slots, self.metrics, liveness,
            state_dir=home.state_dir, crashes=self.crashes,
        )  # fmt: skip
        self.degraded_reason: Callable[[], str | None] = lambda: None

    def bind(self, policy: RequestPolicy) -> None:
        """Size, admit and relay this model's requests under ``policy`` (the governor's
        questions about this model, or ``NoPolicy``)."""
        s = self.settings
        config = self.engine.config
        limits = TokenLimits(s.max_tokens_cap, default_max_tokens(s, config.n_ctx_slot))
        self.sizing = Sizing(policy, limits, settings=lambda: self.engine.config,
                             slots=lambda: self.queue.slots)  # fmt: skip
        self.relay = Relay(self.engine, self.queue, self.flights, self.metrics, policy,
                           self.sizing, retry_after=RetryAfter(s.retry_after_s,
                                                               s.retry_after_max_s),
                           sessions=self.sessions, crashes=self.crashes)  # fmt: skip
        self.dialects = DialectContext(self.relay.call_json, self.sizing, self.model,
                                       self.sessions, self.vision)  # fmt: skip

    # ------------------------------------------------------------ what others read

    @property
    def name(self) -> str:
        return self.model.id

    @property
    def state(self) -> str:
        """The engine's state; ``unloaded`` for an on-demand model parked while not
        needed, ``degraded`` while it serves with a reason to say so."""
        state = self.engine.state
        if self.unloaded:
            return "unloaded"
        if self.engine.recycling or (state == "ready" and self.degraded_reason()):
            return "degraded"  # a recycle's restart too: requests wait in the queue
        return state

    @property
    def unloaded(self) -> bool:
        """An on-demand model out of memory by its residency (idle, evicted, or never
        needed yet), not parked by the governor."""
        return self._unloaded and (self.engine.parked or self.engine.pid is None)

    def busy(self) -> bool:
        """Whether requests hold, wait for or are on their way to this engine: such an
        engine is never evicted to make room."""
        q = self.queue
        return bool(self.users or len(self.flights) or q.busy or q.waiting)

    def touch(self) -> None:
        self.last_used_s = time.monotonic()

    # ------------------------------------------------------------ the engine's callbacks

    def _engine_state(self, state: str) -> None:
        self.metrics.set_state(self.state)
        self.queue.resize(self.engine.config.n_parallel)
        if self._on_state is not None:
            self._on_state(self, state)

    def _engine_restarted(self) -> None:
        self.metrics.engine_restarts.inc()

    def _engine_failed(self) -> None:
        if self._on_failed is not None:
            self._on_failed(self)

    # ------------------------------------------------------------ life

    async def start(self) -> None:
        """Start its supervisor: a pinned model loads now, an on-demand one stays
        unloaded until a request needs it."""
        await self.engine.start(parked=self._unloaded)
        self.liveness.start()

    async def load(self) -> None:
        """Start an unloaded model's engine (it is ``loading`` until it serves)."""
        self._unloaded = False
        self.touch()
        await self.engine.resume()

    async def evict(self, reason: str) -> bool:
        """Unload an idle on-demand model (all its memory returned at once); False, and
        nothing done, for a pinned, busy or already unloaded one."""
        if not self.residency.on_demand or self._unloaded or self.busy():
            return False
        self._unloaded = True
        await self.engine.park(reason)
        self.metrics.set_state(self.state)
        return True

    async def stop(self) -> None:
        await self.liveness.aclose()
        await self.engine.stop()
