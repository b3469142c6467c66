"""One ``slmguard serve``, as a library: :func:`build_server` makes it, :class:`Server` runs it.

The shape of uvicorn's ``Server(config)``: the settings (and the plan) go in,
every part is built once and in plain sight, and :meth:`Server.run` (or
``await`` :meth:`Server.serve` in a running loop) serves until stopped.
``slmguard serve`` maps its flags to the settings and prints; the tests and
the benchmarks build their servers with the same function.

:func:`build_server` checks what can fail before anything starts, each with
its exit status: the plan's model file (65/66/78), an API key off loopback
(78), an admin token equal to it (78), the serve extra's modules (69), a plan
naming an engine binary the operator did not choose (78), the engine binary and
its version (69), whether it bounds a grammar's work per token (its ``--help``;
without it, logged, and the parse stacks are simulated before it), the model's
header (65/66), the backend the plan's engine
needs among the binary's ``--list-devices`` (78), a context beyond the model's trained
one (78), flags over the plan's memory settings that its limits cannot hold (78:
re-budgeted with the plan's own arithmetic, :func:`~slmguard.serve.modelcheck.check_budget`;
the governor takes the re-budgeted parts), the session store (74). Then :class:`Server`
builds, in order, with their callbacks given to their constructors:

- the slot queue and the requests in flight;
- the engine process (its state changes resize the queue, set the metrics'
  state and tell systemd; its restarts are counted; its failure stops the
  server), its cached ``/slots`` and the metrics that read them;
- the memory governor, driving the engine through
  :class:`~slmguard.serve.control.GovernedEngine` (without ``--no-governor``);
- the bounds every request body is checked against (:mod:`slmguard.serve.bounds`);
- the relay, asking the governor (or :class:`~slmguard.governor.request.NoPolicy`)
  about every generation and refusing a request the engine died running;
- the liveness check.

Nothing starts until :meth:`Server.serve`: the engine, the liveness loop, the
governor's loop, then uvicorn; on the way out they stop in reverse and the
engine's runtime directory is removed (unless systemd owns it).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slmguard import notify, paths
from slmguard.engines import grammar_bound
from slmguard.errors import (
    ConfigError,
    EngineError,
    EngineUnavailableError,
    PlanError,
    UnsafeBindError,
)
from slmguard.governor.request import NoPolicy
from slmguard.governor.runtime import Governor, GovernorConfig
from slmguard.governor.signal import MemorySignal
from slmguard.host.process import set_oom_score_adj
from slmguard.netaddr import is_loopback
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.schema import Plan
from slmguard.serve.blame import CrashMemory
from slmguard.serve.bounds import Bounds, Limits
from slmguard.serve.control import GovernedEngine
from slmguard.serve.engine import EngineProcess, RestartPolicy
from slmguard.serve.flights import Flights
from slmguard.serve.liveness import Liveness, LivenessSettings
from slmguard.serve.llamaserver import (
    RANK_POOLING,
    EngineConfig,
    check_backend,
    engine_env,
    engine_version,
    find_llama_server,
)
from slmguard.serve.metrics import ServeMetrics
from slmguard.serve.modelcheck import check_budget, probe_model
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
from slmguard.serve.sessions import FILENAME, SessionService, SessionStore
from slmguard.serve.slots import SlotsView
from slmguard.settings import (
    ServeSettings,
    Tokens,
    admin_token,
    api_key,
    default_max_tokens,
    engine_settings,
)

log = logging.getLogger(__name__)

#: Said in the startup line, /v1/models and the README: the embedded model is not a chat model.
BASE_MODEL_NOTE = (
    "the embedded Gemma 3 270M is a base (pretrained) model: it continues text well "
    "(/v1/completions) but its chat answers are nonsense; serve an instruction-tuned GGUF "
    "with --model for chat"
)

# What the front imports from the serve extra (pyproject.toml), checked before the
# model loads so a missing one is one line, not a traceback after a minute.
SERVE_MODULES = (
    ("fastapi", "the web stack (fastapi)"),
    ("uvicorn", "the web stack (uvicorn)"),
    ("prometheus_client", "prometheus-client"),
)


@dataclass(frozen=True)
class ServedModel:
    """The model the engine serves, as the routes describe it."""

    id: str
    path: str
    file_bytes: int
    sha256: str | None = None
    arch: str = ""
    n_ctx_train: int = 0
    n_vocab: int = 0  # token ids are 0..n_vocab-1 (0: unknown, not checked)
    embeddings: bool = False  # the GGUF declares a pooling type (an embedding model)
    rerank: bool = False  # its pooling type is rank (a reranker: /v1/rerank)
    causal: bool = True  # False: an encoder (BERT), each engine task computed in one batch
    rerank_template: str | None = None  # the GGUF's rerank prompt ({query}, {document})
    aliases: tuple[str, ...] = ()  # more names clients may use (--model-alias)
    chat_template: bool = False  # the GGUF carries a chat template
    note: str | None = None  # e.g. BASE_MODEL_NOTE for the embedded base model
    created_s: int = field(default_factory=lambda: int(time.time()))

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the model answers to: its id, then its aliases."""
        return (self.id, *(a for a in self.aliases if a != self.id))


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
        self.relay = Relay(
            self.engine, self.queue, self.flights, self.metrics, self.governor or NoPolicy(),
            sessions=sessions, model_id=model.id, max_tokens_cap=s.max_tokens_cap,
            crashes=crashes,
            default_max_tokens=default_max_tokens(s, config.n_ctx_slot),
            one_batch=not model.causal, rerank_template=model.rerank_template,
        )  # fmt: skip
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
        if state == "ready" and self.degraded_reasons():
            return "degraded"
        return state

    def degraded_reasons(self) -> dict[str, str]:
        reason = self.governor.degraded_reason if self.governor is not None else None
        return {"memory": reason} if reason else {}

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

    async def serve(self, sock: socket.socket) -> int:
        """Serve on ``sock`` until stopped. Returns 0, or raises the engine's load error,
        or EngineError when it kept dying."""
        import uvicorn

        from slmguard.serve.app import create_app

        config = uvicorn.Config(
            create_app(self),
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

    def run(self, sock: socket.socket) -> int:
        """The process's life: fault log, the front's oom_score_adj, the event loop."""
        set_oom_score_adj(self.settings.front_oom_score_adj, who="the front")
        fault_file = open_fault_log(self.state_dir / "faults" / "front.log")
        try:
            with contextlib.closing(sock):
                return run_loop(self.serve(sock))
        finally:
            if fault_file is not None:
                fault_file.close()


def build_server(settings: ServeSettings, plan: Plan | None) -> Server:
    """A server for these settings and this plan, checked and built, not started."""
    s = settings
    state_dir = s.state_dir or paths.state_dir()
    tokens = _tokens(s)
    check_serve_stack(s)
    binary = _engine_binary(s, plan)
    version = engine_version(binary)
    bounded = _grammar_bound(binary)
    engine_cfg = engine_settings(s, plan)
    check_backend(binary, engine_cfg)  # a GPU plan on a binary without that backend: 78 now
    planned = None
    if plan is not None:  # the plan's model (or --model checked against it): 65/66/78 now
        from slmguard.plan.model import model_for_plan

        planned = model_for_plan(plan, s.model, state_dir=state_dir)
    from slmguard.default_model import ensure_default_model, is_default_model, stamped_digest

    if planned is not None:
        model_path, sha256 = Path(str(planned.path)), planned.sha256
    elif s.model is not None:
        model_path, sha256 = s.model, None
    else:
        model_path = ensure_default_model(paths.model_dir())
        sha256 = stamped_digest(model_path)
    facts = probe_model(Path(model_path))
    # The base-model note on every path: planned, given with --model, or embedded.
    embedded = is_default_model(sha256 or stamped_digest(Path(model_path)))
    config = EngineConfig.of(
        engine_cfg,
        model_path=str(Path(model_path).resolve()),
        chat_template_file=str(s.chat_template_file.resolve()) if s.chat_template_file else None,
        pooling_type=facts.pooling_type,
    )
    check_context(config, facts)
    if plan is not None:  # flags over its memory settings: re-budgeted for them, or 78 now
        plan = check_budget(plan, s, engine_cfg, Path(model_path))
    model = _served_model(s, Path(model_path), config, facts, sha256=sha256, embedded=embedded)
    sessions = SessionService(SessionStore.open(state_dir / FILENAME)) if s.sessions else None
    governor = GovernorConfig.for_model(plan, facts, kv_type=config.kv_type) if s.governor else None
    runtime, owned = runtime_dir()
    return Server(
        s, model, config, binary=binary, version=version, tokens=tokens, sessions=sessions,
        state_dir=state_dir, runtime_dir=runtime, owns_runtime_dir=owned, governor=governor,
        plan_limit_bytes=plan.limits.memory_high_bytes if plan is not None else None,
        plan_device_bytes=plan.limits.device_bytes if plan is not None else 0,
        engine_environ=engine_env(config, state_dir),  # a Vulkan engine's shader cache
        grammar_bound=bounded,
    )  # fmt: skip


def _grammar_bound(binary: Path) -> bool:
    """Whether the engine build stops a request whose grammar needs too much work per
    token (slmguard's engine patch, ``--grammar-max-work``), said at start either way."""
    bounded = grammar_bound(binary)
    if bounded:
        log.info("engine %s bounds a grammar's work per token (--grammar-max-work): an "
                 "ambiguous grammar is refused alone, 400 naming its field", binary)  # fmt: skip
    else:
        log.warning(
            "engine %s has no grammar bound (a build without slmguard's engine patch): an "
            "ambiguous grammar or JSON schema can stall every client's decoding until the "
            "liveness check restarts the engine; grammars and schemas are pre-checked by "
            "simulating its parse stacks, best effort (docs/serve.md, 'Constrained "
            "decoding')", binary,
        )  # fmt: skip
    return bounded


def check_context(config: EngineConfig, facts: ModelFacts) -> None:
    """A context per slot beyond the model's trained context is refused (78) before the
    engine starts, with the numbers (llama.cpp would try to allocate it and fail late)."""
    if facts.n_ctx_train and config.n_ctx_slot > facts.n_ctx_train:
        raise PlanError(
            f"a context of {config.n_ctx_slot:,} tokens per slot ({config.n_ctx:,} in all, "
            f"{config.n_parallel} slot(s)) is beyond {facts.arch}'s trained context of "
            f"{facts.n_ctx_train:,} tokens",
            hint=f"give --ctx {facts.n_ctx_train} or less (tokens per slot)",
        )


def _tokens(s: ServeSettings) -> Tokens:
    """The API key and the admin token (they must differ: 78); an API key is required off
    loopback (78)."""
    tokens = Tokens(api_key(s), admin_token(s))
    if not is_loopback(s.host) and not tokens.api_key:
        raise UnsafeBindError(s.host)
    return tokens


def _engine_binary(s: ServeSettings, plan: Plan | None) -> Path:
    """The engine binary: the operator's (``--llama-server``, its variable), else the one
    slmguard selects. A plan names an executable only to confirm it: a plan is edited by
    hand and copied between machines, so one naming another binary is refused (78) before
    anything runs it."""
    if s.llama_server is not None:
        return find_llama_server(s.llama_server)
    planned = plan.engine.llama_server if plan is not None else None
    if planned is None:
        return find_llama_server(None)
    try:
        selected: Path | None = find_llama_server(None)
    except EngineUnavailableError:
        selected = None
    if selected is None or not _same_file(Path(planned), selected):
        raise ConfigError(
            f"the plan's engine.llama_server {planned} is not the engine slmguard selects "
            f"({selected or 'none found'}); a plan does not choose the executable to run",
            hint=f"to run it, pass --llama-server {planned}",
        )
    return selected


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def check_serve_stack(s: ServeSettings) -> None:
    """The serve extra's modules (69) and the chat template file (78), before the model loads."""
    for module, component in SERVE_MODULES:
        if importlib.util.find_spec(module) is None:
            raise EngineUnavailableError(component)
    if s.chat_template_file is not None and not s.chat_template_file.is_file():
        raise ConfigError("--chat-template-file: no such file", path=s.chat_template_file)


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
