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
import dataclasses
import functools
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from slmguard import notify
from slmguard.errors import (
    EngineError,
)
from slmguard.governor.policy import MemoryModel
from slmguard.governor.request import NoPolicy
from slmguard.governor.runtime import Governor, GovernorConfig, Keeping
from slmguard.governor.signal import MemorySignal
from slmguard.host.process import set_oom_score_adj
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.parts import hot_bytes
from slmguard.plan.schema import Plan, Serving
from slmguard.serve.bounds import Bounds
from slmguard.serve.dialects.context import DialectContext
from slmguard.serve.engine import EngineProcess
from slmguard.serve.flights import Flights
from slmguard.serve.liveness import Liveness
from slmguard.serve.llamaserver import (
    RANK_POOLING,
    EngineConfig,
    engine_env,
)
from slmguard.serve.metrics import ServeMetrics
from slmguard.serve.modelengine import EngineHome, ModelEngine, Residency, ServedEngine
from slmguard.serve.models import ModelTable
from slmguard.serve.queue import SlotQueue
from slmguard.serve.relay import Relay
from slmguard.serve.residency import PlanResidency, ResidencyManager
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
from slmguard.serve.slots import SlotsView
from slmguard.serve.startup import BoardStart, Start, prepare
from slmguard.serve.vision import ServedVision
from slmguard.settings import (
    ServeSettings,
    Tokens,
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

    ``model`` and ``config`` are the primary model's (``residency`` how it is kept:
    pinned unless said); ``others`` the further models of a board, each with its own
    engine and parts (:class:`~slmguard.serve.modelengine.ModelEngine`, in
    :attr:`models`). ``governor`` is the governor's configuration (None:
    ``--no-governor``): one governor over every engine.
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
        residency: Residency | None = None,
        others: Sequence[ServedEngine] = (),
        resident_sets: tuple[frozenset[str], ...] = (),
        vision: ServedVision | None = None,
        grammar_bound: bool = True,
    ) -> None:
        self.settings = settings
        self.tokens = tokens
        self.sessions = sessions
        self.state_dir = state_dir
        self.runtime_dir = runtime_dir
        self.owns_runtime_dir = owns_runtime_dir
        self.grammar_bound = grammar_bound  # the engine stops a grammar past its work bound
        self.metrics = ServeMetrics(labelled=bool(others))
        primary = ServedEngine(model, config, residency or Residency(), engine_environ, vision)
        engines = [
            self._model_engine(spec, runtime_dir if i == 0 else runtime_dir / f"model-{i}",
                               binary=binary, version=version, named=bool(others))
            for i, spec in enumerate((primary, *others))
        ]  # fmt: skip
        self.models = ModelTable(engines)
        self.governor = (
            None
            if governor is None
            else self._governor(governor, plan_limit_bytes, plan_device_bytes)
        )
        gov = self.governor
        for engine in self.models:
            engine.bind(NoPolicy() if gov is None else gov.for_model(engine.name))
            if gov is not None:
                engine.degraded_reason = functools.partial(getattr, gov, "degraded_reason")
        self.residency = ResidencyManager(
            self.models, self.governor or PlanResidency(self.models, resident_sets)
        )
        # a request's text within --max-body-bytes, and beside it the images it may carry
        # (the primary's projector: a board's further models serve text)
        self.body_limit_bytes = settings.max_body_bytes + (vision.body_room_bytes if vision else 0)
        self._uvicorn: Any = None
        self._announced = False
        self.url = f"http://{settings.host}:{settings.port}"  # the bound socket's, once serving

    def _model_engine(
        self, spec: ServedEngine, runtime: Path, *, binary: Path, version: str, named: bool
    ) -> ModelEngine:
        home = EngineHome(binary, version, runtime, self.state_dir, spec.environ)
        return ModelEngine(
            self.settings, spec.model, spec.config, home, metrics=self.metrics,
            sessions=self.sessions, residency=spec.residency, vision=spec.vision,
            grammar_bound=self.grammar_bound, on_state=self._engine_state,
            on_failed=self._engine_failed,
            log_name=spec.model.id.replace(".", "_") if named else None,
        )  # fmt: skip

    def _governor(
        self, config: GovernorConfig, plan_limit_bytes: int | None, plan_device_bytes: int
    ) -> Governor:
        """The memory governor over every engine, its metrics in this server's registry
        (the engines' device memory outside the cgroup counted when the plan allows some)."""
        from slmguard.governor.metrics import GovernorCollector

        primary = self.models.primary
        signal = MemorySignal(
            budget_bytes=self.settings.memory_budget_bytes,
            plan_limit_bytes=plan_limit_bytes,
            pids=lambda: [os.getpid(), *(p for m in self.models if (p := m.engine.pid))],
            device_bytes=plan_device_bytes,
            device_pid=lambda: primary.engine.pid,
        )
        governor = Governor(
            signal, config, primary.engine.config.n_ctx, engine=primary.control,
            sessions=self.sessions.store if self.sessions is not None else None,
            slot_tokens=primary.control.slot_tokens, name=primary.name,
            keeping=_keeping(primary),
        )  # fmt: skip
        for engine in list(self.models)[1:]:
            governor.add_model(
                engine.name, engine.control, engine.engine.config.n_ctx,
                memory=config.models.get(engine.name, MemoryModel()),
                slot_tokens=engine.control.slot_tokens, keeping=_keeping(engine),
            )  # fmt: skip
        self.metrics.registry.register(GovernorCollector(governor))
        return governor

    # ------------------------------------------------------------ the primary's parts

    @property
    def primary(self) -> ModelEngine:
        return self.models.primary

    @property
    def model(self) -> ServedModel:
        return self.primary.model

    @property
    def engine(self) -> EngineProcess:
        return self.primary.engine

    @property
    def queue(self) -> SlotQueue:
        return self.primary.queue

    @property
    def flights(self) -> Flights:
        return self.primary.flights

    @property
    def slots(self) -> SlotsView:
        return self.primary.slots

    @property
    def liveness(self) -> Liveness:
        return self.primary.liveness

    @property
    def bounds(self) -> Bounds:
        return self.primary.bounds

    @property
    def relay(self) -> Relay:
        return self.primary.relay

    @property
    def dialects(self) -> DialectContext:
        return self.primary.dialects

    # ------------------------------------------------------------ what the routes read

    @property
    def state(self) -> str:
        """The primary engine's state, ``degraded`` while it serves with a reason to say
        so (the governor's, or a pinned model of a board that does not serve)."""
        state = self.engine.state
        if (state == "ready" or self.engine.recycling) and self.degraded_reasons():
            return "degraded"  # a recycle's restart too: requests wait in the queue
        return state

    def degraded_reasons(self) -> dict[str, str]:
        reasons = {}
        reason = self.governor.degraded_reason if self.governor is not None else None
        if reason:
            reasons["memory"] = reason
        down = [
            f"{m.name} is {m.engine.state}"
            for m in list(self.models)[1:]
            if not m.residency.on_demand and m.engine.state != "ready" and not m.engine.recycling
        ]
        if self.engine.recycling:
            reasons["engine"] = "recycling the engine (leak check): requests wait in the queue"
        down += [
            f"{m.name} is recycling its engine (leak check): its requests wait in its queue"
            for m in list(self.models)[1:]
            if m.engine.recycling
        ]
        if down:
            reasons["models"] = "; ".join(down)
        return reasons

    # ------------------------------------------------------------ the engines' callbacks

    def _engine_state(self, model: ModelEngine, state: str) -> None:
        """sd_notify follows the engines: READY once every pinned model served once."""
        text = self._status_text()
        pinned = [m for m in self.models if not m.residency.on_demand]
        if all(m.engine.state == "ready" for m in pinned) and not self._announced:
            self._announced = True
            for m in pinned:
                config = m.engine.config
                log.info(
                    "ready: %s serving %s, %d slot(s) x %d tokens of context",
                    self.url, m.name, config.n_parallel, config.n_ctx_slot,
                )  # fmt: skip
            notify.ready(text)
        else:
            notify.status(text)

    def _status_text(self) -> str:
        return "; ".join(
            f"engine {m.state}; model {m.name}; n_ctx {m.engine.config.n_ctx_slot}"
            for m in self.models
        )

    def _engine_failed(self, model: ModelEngine) -> None:
        """A pinned model's engine failed: the server exits (70) for systemd; an on-demand
        model's is loaded again by its next request."""
        if model.residency.on_demand:
            self.residency.failed(model)
            return
        self.stop()

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
        for model in self.models:
            model.metrics.set_state(model.state)
        watchdog = start_watchdog(self._watchdog_ok)
        for model in self.models:
            await model.start()
        if self.governor is not None:
            self.governor.start()
        self.residency.start()
        try:
            await self._uvicorn.serve(sockets=[sock])
        finally:
            await self._shut_down(watchdog)
        for model in self.models:
            if model.residency.on_demand:
                continue  # its failures were answered, not fatal
            engine = model.engine
            if engine.load_error is not None:
                raise engine.load_error
            if engine.state == "failed":
                what = f"the engine of {model.name}" if self.models.several else "the engine"
                raise EngineError(
                    f"{what} died {engine.restarts} times within "
                    f"{engine.policy.window_s:.0f} s; giving up",
                    hint="see the engine's log lines above (logger slmguard.engine)",
                )
        return 0

    def _watchdog_ok(self) -> bool:
        """Feed systemd's watchdog while every engine's liveness check says so (an
        on-demand model whose engine gave up is not a reason: its next request loads it)."""
        return all(
            model.liveness.watchdog_ok()
            for model in self.models
            if not (model.residency.on_demand and model.engine.state == "failed")
        )

    async def _shut_down(self, watchdog: asyncio.Task[None] | None) -> None:
        notify.stopping()
        if watchdog is not None:
            watchdog.cancel()
        await self.residency.aclose()
        if self.governor is not None:
            await self.governor.aclose()
        for model in self.models:
            await model.stop()
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
    :class:`~slmguard.serve.startup.Start` (:func:`~slmguard.serve.startup.prepare`); a
    board's plan adds one engine per further model (``plan.models``)."""
    start = prepare(settings, plan)
    s, config = start.settings, start.engine
    serving = start.serving
    model = _served_model(
        s.model_name or (serving.name if serving else start.model_path.name.removesuffix(".gguf")),
        (*s.model_alias, *(serving.aliases if serving else ())), config.model_path, start.facts,
        sha256=start.sha256, embedded=start.embedded, role=serving.role if serving else None,
        chat_template_file=s.chat_template_file is not None,
    )  # fmt: skip
    sessions = SessionService(SessionStore.open(start.state_dir / FILENAME)) if s.sessions else None
    governed = start.plan
    names = {serving.name: model.id} if serving else {}  # the plan's name of the primary -> its id
    governor = _governor_config(start, names) if s.governor else None
    others = tuple(_board_engine(b, start.state_dir) for b in start.board)
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
        residency=_residency(serving, hot_bytes(governed.budget) if governed else 0),
        others=others, resident_sets=_resident_sets(governed, names),
    )  # fmt: skip


def _governor_config(start: Start, names: dict[str, str]) -> GovernorConfig:
    """The governor's configuration from the plan: the primary's memory model, and each
    further model's from its own engine and budget (the GGUF header's KV cost without
    one), the resident sets by served name."""
    config = GovernorConfig.for_model(start.plan, start.facts, kv_type=start.engine.kv_type)
    models = {
        b.serving.name: GovernorConfig.for_model(b.plan, b.facts, kv_type=b.engine.kv_type).model
        for b in start.board
    }
    return dataclasses.replace(
        config, models=models, resident_sets=_resident_sets(start.plan, names)
    )


def _resident_sets(plan: Plan | None, names: dict[str, str]) -> tuple[frozenset[str], ...]:
    """The plan's sets of models that may be resident together, by served id (none: no
    rule beyond memory)."""
    if plan is None:
        return ()
    return tuple(frozenset(names.get(n, n) for n in rs.models) for rs in plan.resident_sets)


def _residency(serving: Serving | None, peak_bytes: int) -> Residency:
    if serving is None:
        return Residency(planned_bytes=peak_bytes)
    return Residency(
        residency=serving.residency, priority=serving.priority,
        idle_unload_s=float(serving.idle_unload_s), planned_bytes=peak_bytes,
    )  # fmt: skip


def _board_engine(b: BoardStart, state_dir: Path) -> ServedEngine:
    """A further model of a board: as served, its engine's settings, how it is kept."""
    from slmguard.default_model import is_default_model

    model = _served_model(
        b.serving.name, b.serving.aliases, b.engine.model_path, b.facts, sha256=b.sha256,
        embedded=is_default_model(b.sha256), role=b.serving.role, chat_template_file=False,
    )  # fmt: skip
    return ServedEngine(model, b.engine, _residency(b.serving, b.peak_bytes),
                        engine_env(b.engine, state_dir))  # fmt: skip


def _keeping(model: ModelEngine) -> Keeping:
    """How the governor sees a model kept: its priority, residency and the server's
    answers about it now (busy, resident, evict)."""
    r = model.residency
    return Keeping(
        priority=r.priority, on_demand=r.on_demand, planned_bytes=r.planned_bytes,
        busy=model.busy, resident=model.control.resident, evict=model.evict,
    )  # fmt: skip


def _served_model(
    name: str, aliases: tuple[str, ...], path: str, facts: ModelFacts, *,
    sha256: str | None, embedded: bool, role: str | None, chat_template_file: bool,
) -> ServedModel:  # fmt: skip
    """What /v1/models and /health say about a model (its id: the name it is served as)."""
    return ServedModel(
        id=name,
        path=path,
        file_bytes=facts.file_bytes,
        sha256=sha256,
        arch=facts.arch,
        n_ctx_train=facts.n_ctx_train,
        n_vocab=facts.n_vocab,
        embeddings=facts.pooling_type is not None,
        rerank=facts.pooling_type == RANK_POOLING,
        causal=facts.causal_attn,
        rerank_template=facts.rerank_template,
        aliases=tuple(dict.fromkeys(aliases)),
        chat_template=facts.chat_template is not None or chat_template_file,
        note=BASE_MODEL_NOTE if embedded else None,
        role=role,
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
