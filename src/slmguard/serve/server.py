"""One ``slmguard serve``, as a library: :func:`build_server` makes it, :class:`Server` runs it.

The shape of uvicorn's ``Server(config)``: the settings (and the plan) go in,
every part is built once and in plain sight, with its callbacks given to its
constructor (the queue and flights, the engine, its slots and metrics, the
governor, the bounds, the sizing, the relay and the dialects' context, the
liveness check), and :meth:`Server.run` (or ``await`` :meth:`Server.serve`)
serves the app it is given until stopped; nothing starts before. It never
imports its app: the CLI composes ``server.run(sock, create_app(server))``.
:func:`build_server` checks what can fail before anything starts, each with its
exit status (the plan's model file, the bind, the tokens, the serve extra, the
engine binary, its backend and
whether it bounds a grammar's work, the model's header and context, flags over the
plan's budget, the session store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from slmguard import notify
from slmguard.errors import (
    EngineError,
)
from slmguard.governor.request import NoPolicy
from slmguard.governor.runtime import Governor, GovernorConfig
from slmguard.governor.signal import MemorySignal
from slmguard.host.process import set_oom_score_adj
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.schema import Plan
from slmguard.serve.blame import CrashMemory
from slmguard.serve.bounds import Bounds, Limits
from slmguard.serve.control import GovernedEngine
from slmguard.serve.dialects.context import DialectContext
from slmguard.serve.engine import EngineProcess, RestartPolicy
from slmguard.serve.flights import Flights
from slmguard.serve.liveness import Liveness, LivenessSettings
from slmguard.serve.llamaserver import (
    RANK_POOLING,
    EngineConfig,
    engine_env,
)
from slmguard.serve.metrics import ServeMetrics
from slmguard.serve.queue import SlotQueue
from slmguard.serve.relay import Relay
from slmguard.serve.runner import (
    open_fault_log,
    quiet_exit_server,
    run_loop,
    stack_name,
    start_watchdog,
    timed_protocol,
)
from slmguard.serve.served import ServedModel
from slmguard.serve.sessions import FILENAME, SessionService, SessionStore
from slmguard.serve.sizing import Sizing, TokenLimits
from slmguard.serve.slots import SlotsView
from slmguard.serve.startup import prepare
from slmguard.serve.vision import ServedVision
from slmguard.settings import (
    ServeSettings,
    Tokens,
    default_max_tokens,
)

log = logging.getLogger(__name__)

#: An ASGI application (the one :func:`slmguard.serve.app.create_app` makes), as uvicorn
#: serves it: the server runs the app it is given and never imports it.
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]

#: Said in the startup line, /v1/models and the README: the embedded model is not a chat model.
BASE_MODEL_NOTE = (
    "the embedded Gemma 3 270M is a base (pretrained) model: it continues text well "
    "(/v1/completions) but its chat answers are nonsense; serve an instruction-tuned GGUF "
    "with --model for chat"
)


class Server:
    """Every part of one server and its life; made by :func:`build_server`.

    ``governor`` is the governor's configuration (None: ``--no-governor``).
    """

    def __init__(
        self,
        settings: ServeSettings,
        model: ServedModel,
        config: EngineConfig,
        *,
        binary: Path,
        version: str,
        tokens: Tokens,
        sessions: SessionService | None,
        state_dir: Path,
        runtime_dir: Path,
        governor: GovernorConfig | None,
        plan_limit_bytes: int | None = None,
        plan_device_bytes: int = 0,
        owns_runtime_dir: bool = True,
        engine_environ: dict[str, str] | None = None,
        vision: ServedVision | None = None,
        grammar_bound: bool = True,
    ) -> None:
        s = settings
        self.settings = settings
        self.model = model
        self.tokens = tokens
        self.sessions = sessions
        self.state_dir = state_dir
        self.runtime_dir = runtime_dir
        self.owns_runtime_dir = owns_runtime_dir
        self.queue = SlotQueue(config.n_parallel, s.queue_size)
        self.flights = Flights()
        restart = RestartPolicy(
            backoff_initial_s=s.restart_backoff_initial_s,
            backoff_max_s=s.restart_backoff_max_s,
            max_restarts=s.restart_max,
            window_s=s.restart_window_s,
        )
        self.grammar_bound = grammar_bound  # the engine stops a grammar past its work bound
        crashes = CrashMemory()  # the engine's crashes, its grammar refusals, their clients
        crashes.grammar_bound = grammar_bound
        self.engine = EngineProcess(
            binary, config, restart, alias=model.id, runtime_dir=runtime_dir, version=version,
            oom_score_adj=s.engine_oom_score_adj, load_timeout_s=s.engine_load_timeout_s,
            on_state=self._engine_state, on_restart=self._engine_restarted,
            on_failed=self.stop, on_exit=crashes.settle, env=engine_environ,
        )  # fmt: skip
        self.slots = SlotsView(self.engine)
        self.metrics = ServeMetrics(self.queue, self.engine, self.slots)
        self.governor = (
            None
            if governor is None
            else self._governor(governor, plan_limit_bytes, plan_device_bytes)
        )
        self.bounds = Bounds(
            Limits.of(s, n_ctx_slot=config.n_ctx_slot, n_vocab=model.n_vocab),
            simulate_stacks=not grammar_bound,
        )
        policy = self.governor or NoPolicy()
        limits = TokenLimits(s.max_tokens_cap, default_max_tokens(s, config.n_ctx_slot))
        sizing = Sizing(policy, limits, settings=lambda: self.engine.config,
                        slots=lambda: self.queue.slots)  # fmt: skip
        self.relay = Relay(self.engine, self.queue, self.flights, self.metrics, policy, sizing,
                           sessions=sessions, crashes=crashes)  # fmt: skip
        self.dialects = DialectContext(self.relay.call_json, sizing, model, sessions, vision)
        # a request's text within --max-body-bytes, and beside it the images it may carry
        self.body_limit_bytes = s.max_body_bytes + (vision.body_room_bytes if vision else 0)
        liveness = LivenessSettings(
            floor_s=s.stall_floor_s,
            factor=s.stall_factor,
            fixed_s=s.stall_timeout_s,
            canary_interval_s=s.canary_interval_s,
        )
        self.liveness = Liveness(
            self.engine, self.flights, self.queue, self.slots, self.metrics, liveness,
            state_dir=state_dir, crashes=crashes,
        )  # fmt: skip
        self._uvicorn: Any = None
        self._announced = False
        self.url = f"http://{s.host}:{s.port}"  # the bound socket's, once serving

    def _governor(
        self, config: GovernorConfig, plan_limit_bytes: int | None, plan_device_bytes: int
    ) -> Governor:
        """The memory governor over this engine, its metrics in this server's registry
        (the engine's device memory outside the cgroup counted when the plan allows some)."""
        from slmguard.governor.metrics import GovernorCollector

        control = GovernedEngine(self.engine, self.queue, self.flights, self.slots)
        signal = MemorySignal(
            budget_bytes=self.settings.memory_budget_bytes,
            plan_limit_bytes=plan_limit_bytes,
            pids=lambda: [p for p in (os.getpid(), self.engine.pid) if p is not None],
            device_bytes=plan_device_bytes,
            device_pid=lambda: self.engine.pid,
        )
        governor = Governor(
            signal, config, self.engine.config.n_ctx, engine=control,
            sessions=self.sessions.store if self.sessions is not None else None,
            slot_tokens=control.slot_tokens,
        )  # fmt: skip
        self.metrics.registry.register(GovernorCollector(governor))
        return governor

    # ------------------------------------------------------------ what the routes read

    @property
    def state(self) -> str:
        """The engine's state, ``degraded`` while it serves with a reason to say so."""
        state = self.engine.state
        if (state == "ready" or self.engine.recycling) and self.degraded_reasons():
            return "degraded"  # a recycle's restart too: requests wait in the queue
        return state

    def degraded_reasons(self) -> dict[str, str]:
        reason = self.governor.degraded_reason if self.governor is not None else None
        reasons = {"memory": reason} if reason else {}
        if self.engine.recycling:
            reasons["engine"] = "recycling the engine (leak check): requests wait in the queue"
        return reasons

    # ------------------------------------------------------------ the engine's callbacks

    def _engine_state(self, state: str) -> None:
        """Metrics, queue size and sd_notify follow the engine (READY the first time)."""
        self.metrics.set_state(self.state)
        config = self.engine.config
        self.queue.resize(config.n_parallel)
        text = f"engine {state}; model {self.model.id}; n_ctx {config.n_ctx_slot}"
        if state == "ready" and not self._announced:
            self._announced = True
            log.info(
                "ready: %s serving %s, %d slot(s) x %d tokens of context",
                self.url, self.model.id, config.n_parallel, config.n_ctx_slot,
            )  # fmt: skip
            notify.ready(text)
        else:
            notify.status(text)

    def _engine_restarted(self) -> None:
        self.metrics.engine_restarts.inc()

    # ------------------------------------------------------------ life

    def stop(self) -> None:
        """Ask :meth:`serve` to return (it drains requests for ``shutdown_grace_s``)."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    async def serve(self, sock: socket.socket, app: ASGIApp) -> int:
        """Serve ``app`` (:func:`slmguard.serve.app.create_app` of this server) on ``sock``
        until stopped. Returns 0, or raises the engine's load error, or EngineError when
        it kept dying."""
        import uvicorn

        config = uvicorn.Config(
            app,
            log_level=logging.getLogger().getEffectiveLevel(),
            access_log=False,
            timeout_graceful_shutdown=int(self.settings.shutdown_grace_s),
            lifespan="off",
            http=timed_protocol(self.settings.header_timeout_s),
        )
        self._uvicorn = quiet_exit_server(uvicorn.Server)(config)
        log.debug("HTTP: %s", stack_name())
        self.url = url_of(sock)
        self.metrics.set_state(self.state)
        watchdog = start_watchdog(self.liveness.watchdog_ok)
        await self.engine.start()
        self.liveness.start()
        if self.governor is not None:
            self.governor.start()
        try:
            await self._uvicorn.serve(sockets=[sock])
        finally:
            await self._shut_down(watchdog)
        engine = self.engine
        if engine.load_error is not None:
            raise engine.load_error
        if engine.state == "failed":
            raise EngineError(
                f"the engine died {engine.restarts} times within "
                f"{engine.policy.window_s:.0f} s; giving up",
                hint="see the engine's log lines above (logger slmguard.engine)",
            )
        return 0

    async def _shut_down(self, watchdog: asyncio.Task[None] | None) -> None:
        notify.stopping()
        if watchdog is not None:
            watchdog.cancel()
        await self.liveness.aclose()
        if self.governor is not None:
            await self.governor.aclose()
        await self.engine.stop()
        if self.sessions is not None:
            self.sessions.close()
        if self.owns_runtime_dir:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.runtime_dir)

    def run(self, sock: socket.socket, app: ASGIApp) -> int:
        """The process's life: fault log, the front's oom_score_adj, the event loop that
        serves ``app``."""
        set_oom_score_adj(self.settings.front_oom_score_adj, who="the front")
        fault_file = open_fault_log(self.state_dir / "faults" / "front.log")
        try:
            with contextlib.closing(sock):
                return run_loop(self.serve(sock, app))
        finally:
            if fault_file is not None:
                fault_file.close()


def build_server(settings: ServeSettings, plan: Plan | None = None) -> Server:
    """A server for these settings and this plan (None: the plan it makes for this host),
    checked and built, not started: every part is built from one record,
    :class:`~slmguard.serve.startup.Start` (:func:`~slmguard.serve.startup.prepare`)."""
    start = prepare(settings, plan)
    s, config = start.settings, start.engine
    model = _served_model(
        s, start.model_path, config, start.facts, sha256=start.sha256, embedded=start.embedded
    )
    sessions = SessionService(SessionStore.open(start.state_dir / FILENAME)) if s.sessions else None
    governed = start.plan
    governor = (
        GovernorConfig.for_model(governed, start.facts, kv_type=config.kv_type)
        if s.governor
        else None
    )
    runtime, owned = runtime_dir()
    return Server(
        s, model, config, binary=start.binary, version=start.version, tokens=start.tokens,
        sessions=sessions, state_dir=start.state_dir, runtime_dir=runtime, owns_runtime_dir=owned,
        governor=governor,
        plan_limit_bytes=governed.limits.memory_high_bytes if governed is not None else None,
        plan_device_bytes=governed.limits.device_bytes if governed is not None else 0,
        engine_environ=engine_env(config, start.state_dir),  # shader cache, projector malloc
        vision=start.vision,
        grammar_bound=start.grammar_bound,
    )  # fmt: skip


def _served_model(
    s: ServeSettings, model_path: Path, config: EngineConfig, facts: ModelFacts, *,
    sha256: str | None, embedded: bool,
) -> ServedModel:  # fmt: skip
    """What /v1/models and /health say about the model (its id: the file's stem as given)."""
    return ServedModel(
        id=s.model_name or model_path.name.removesuffix(".gguf"),
        path=config.model_path,
        file_bytes=facts.file_bytes,
        sha256=sha256,
        arch=facts.arch,
        n_ctx_train=facts.n_ctx_train,
        n_vocab=facts.n_vocab,
        embeddings=facts.pooling_type is not None,
        rerank=facts.pooling_type == RANK_POOLING,
        causal=facts.causal_attn,
        rerank_template=facts.rerank_template,
        aliases=tuple(dict.fromkeys(s.model_alias)),
        chat_template=facts.chat_template is not None or s.chat_template_file is not None,
        note=BASE_MODEL_NOTE if embedded else None,
    )


def url_of(sock: socket.socket) -> str:
    """The base URL a client on this host uses for a listening socket."""
    address = sock.getsockname()
    host, port = str(address[0]), int(address[1])
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def runtime_dir() -> tuple[Path, bool]:
    """A private directory for the engine's socket and key (0700; a short path: unix
    socket paths are limited to 107 bytes), and whether it is ours to remove.
    systemd's ``RuntimeDirectory=`` wins (systemd removes it)."""
    given = os.environ.get("RUNTIME_DIRECTORY")
    if given:
        path = Path(given.split(":")[0]) / "engine"
        path.mkdir(mode=0o700, exist_ok=True)
        return path, False
    base = os.environ.get("XDG_RUNTIME_DIR") or None
    return Path(tempfile.mkdtemp(prefix="slmguard-", dir=base)), True
