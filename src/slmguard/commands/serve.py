"""``slmguard serve``: an OpenAI-compatible front guarding a supervised llama-server child."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slmguard.governor.runtime import Governor
    from slmguard.plan.modelfacts import ModelFacts
    from slmguard.plan.schema import ModelSpec
    from slmguard.serve.context import ServeContext, ServedModel
    from slmguard.serve.engine import EngineProcess
    from slmguard.serve.liveness import Liveness
    from slmguard.serve.llamaserver import EngineConfig
    from slmguard.serve.sessions import SessionService
    from slmguard.settings import ServeSettings

ORDER = 40

log = logging.getLogger(__name__)

EXAMPLE = """\
Example:
  slmguard serve                                  # default model on 127.0.0.1:8080
  slmguard serve --model qwen2.5-0.5b-instruct-q4_k_m.gguf --n-ctx 8192 --n-parallel 4
  slmguard serve --plan plan.json --host 0.0.0.0 --api-key-file /etc/slmguard/key
  slmguard serve --llama-server /opt/llama.cpp/build/bin/llama-server   # the board's build
  curl -s localhost:8080/v1/completions -H 'content-type: application/json' \\
    -d '{"model": "gemma-3-270m-q4_k_m", "prompt": "The capital of France is"}'

The embedded default model is a base (pretrained) model: it continues text well, but
its chat answers are nonsense. Chat with an instruction-tuned GGUF (--model).
Every option can also be set as an environment variable: --n-ctx is SLMGUARD_N_CTX.
With --plan, serve serves the plan's model file after checking its size and sha256
(--model FILE instead: for a file plan, the same size and sha256; for a preset plan, the
preset's architecture, layers and trained context); a preset plan needs --model.
Exit status: 0 stopped, 64 usage, 65 model unusable, not the planned file, or the engine
cannot load it, 66 model missing, 69 engine binary or web stack not installed, 70 engine
kept dying, 78 bad settings or plan, a preset plan without --model, or an unsafe bind.
"""

# What the front imports from the serve extra (pyproject.toml), checked before the
# model loads so a missing one is one line, not a traceback after a minute.
SERVE_MODULES = (
    ("fastapi", "the web stack (fastapi)"),
    ("uvicorn", "the web stack (uvicorn)"),
    ("prometheus_client", "prometheus-client"),
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from slmguard.settings import add_arguments

    p = sub.add_parser(
        "serve",
        help="serve a GGUF model over an OpenAI-compatible HTTP API",
        description="Serve a GGUF model over an OpenAI-compatible HTTP API. The engine is "
        "llama.cpp's llama-server, run as a child process the server restarts when it dies "
        "(OOM kill, crash) and guards with a memory governor; the server itself binds "
        "127.0.0.1 unless an API key is set.\n\n" + EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(run=run)


def _require(module: str, component: str) -> None:
    from slmguard.errors import EngineUnavailableError

    if importlib.util.find_spec(module) is None:
        raise EngineUnavailableError(component)


def runtime_dir() -> Path:
    """A private directory for the engine's socket and key (0700; a short path: unix
    socket paths are limited to 107 bytes). systemd's ``RuntimeDirectory=`` wins."""
    given = os.environ.get("RUNTIME_DIRECTORY")
    base = os.environ.get("XDG_RUNTIME_DIR") or None
    if given:
        path = Path(given.split(":")[0]) / "engine"
        path.mkdir(mode=0o700, exist_ok=True)
        return path
    return Path(tempfile.mkdtemp(prefix="slmguard-", dir=base))


def run(args: argparse.Namespace) -> int:
    from slmguard import paths, settings
    from slmguard.plan.schema import load_plan
    from slmguard.serve.llamaserver import engine_version, find_llama_server
    from slmguard.serve.modelcheck import probe_model

    plan = load_plan(args.plan) if args.plan is not None else None
    s = settings.resolve(args, plan=plan)
    state_dir = s.state_dir or paths.state_dir()
    planned = None
    if plan is not None:  # the plan's model (or --model checked against it): 65/66/78 now
        from slmguard.plan.model import model_for_plan

        planned = model_for_plan(plan, s.model, state_dir=state_dir)
    key, admin = _access_tokens(s)
    _check_serve_stack(s)
    binary = find_llama_server(s.llama_server)
    version = engine_version(binary)
    model_path, sha256, embedded = _model_file(s, planned)
    facts = probe_model(Path(model_path))

    from slmguard.serve.context import ServeContext
    from slmguard.serve.queue import SlotQueue

    config = _engine_config(s, model_path)
    model = _served_model(s, config, facts, model_path, sha256=sha256, embedded=embedded)
    rundir = runtime_dir()
    ctx = ServeContext(
        settings=s,
        engine=_engine_process(s, binary, config, model, rundir),
        queue=SlotQueue(config.n_parallel, s.queue_size),
        model=model,
        engine_version=version,
        sessions=_sessions(s, state_dir),
        api_key=key,
        admin_token=admin,
    )
    ctx.liveness = _liveness(ctx, s, state_dir)
    governor = None
    if s.governor:
        from slmguard.governor.serving import build_governor, install

        governor = build_governor(
            ctx, plan=plan, facts=facts, state_dir=state_dir, budget_bytes=s.memory_budget_bytes
        )
        install(ctx, governor)
    return _serve(ctx, governor, state_dir=state_dir, rundir=rundir)


def _access_tokens(s: ServeSettings) -> tuple[str | None, str | None]:
    """The API key and the admin token; an API key is required off loopback (78)."""
    from slmguard import settings
    from slmguard.errors import UnsafeBindError
    from slmguard.netaddr import is_loopback

    key = settings.api_key(s)
    if not is_loopback(s.host) and not key:
        raise UnsafeBindError(s.host)
    return key, settings.admin_token(s)


def _check_serve_stack(s: ServeSettings) -> None:
    """The serve extra's modules (69) and the chat template file (78), before the model loads."""
    for module, component in SERVE_MODULES:
        _require(module, component)
    if s.chat_template_file is not None and not s.chat_template_file.is_file():
        from slmguard.errors import ConfigError

        raise ConfigError("--chat-template-file: no such file", path=s.chat_template_file)


def _model_file(s: ServeSettings, planned: ModelSpec | None) -> tuple[Path, str | None, bool]:
    """The model to serve: (path, known sha256, whether it is the embedded default model).

    The plan's file, else --model, else the embedded default model (fetched when absent).
    """
    from slmguard import paths

    if planned is not None:
        return Path(str(planned.path)), planned.sha256, False
    if s.model is not None:
        return s.model, None, False
    from slmguard.default_model import ensure_default_model, stamped_digest

    model_path = ensure_default_model(paths.model_dir())
    return model_path, stamped_digest(model_path), True


def _engine_config(s: ServeSettings, model_path: Path) -> EngineConfig:
    """llama-server's settings, from the serve settings."""
    from slmguard import settings
    from slmguard.serve.llamaserver import EngineConfig

    return EngineConfig(
        model_path=str(Path(model_path).resolve()),
        n_ctx=s.n_ctx,
        n_batch=s.n_batch,
        n_ubatch=s.n_ubatch,
        n_threads=s.n_threads or settings.default_threads(),
        kv_type=s.kv_type,
        use_mmap=s.use_mmap,
        use_mlock=s.use_mlock,
        swa_full=s.swa_full,
        n_parallel=s.n_parallel,
        kv_unified=s.kv_unified,
        flash_attn=s.flash_attn,
        cache_ram_mib=s.cache_ram_mib,
        chat_template_file=str(s.chat_template_file.resolve()) if s.chat_template_file else None,
    )


def _served_model(
    s: ServeSettings,
    config: EngineConfig,
    facts: ModelFacts,
    model_path: Path,
    *,
    sha256: str | None,
    embedded: bool,
) -> ServedModel:
    """What /v1/models and /health say about the model."""
    from slmguard.serve.context import BASE_MODEL_NOTE, ServedModel

    return ServedModel(
        id=s.model_name or Path(model_path).name.removesuffix(".gguf"),
        path=config.model_path,
        file_bytes=facts.file_bytes,
        sha256=sha256,
        arch=facts.arch,
        n_ctx_train=facts.n_ctx_train,
        n_vocab=facts.n_vocab,
        embeddings=facts.pooling_type is not None,
        chat_template=facts.chat_template is not None or s.chat_template_file is not None,
        note=BASE_MODEL_NOTE if embedded else None,
    )


def _engine_process(
    s: ServeSettings, binary: Path, config: EngineConfig, model: ServedModel, rundir: Path
) -> EngineProcess:
    """The supervised llama-server child and its restart policy."""
    from slmguard.serve.engine import EngineProcess, RestartPolicy

    policy = RestartPolicy(
        backoff_initial_s=s.restart_backoff_initial_s,
        backoff_max_s=s.restart_backoff_max_s,
        max_restarts=s.restart_max,
        window_s=s.restart_window_s,
    )
    return EngineProcess(
        binary,
        config,
        policy,
        alias=model.id,
        runtime_dir=rundir,
        oom_score_adj=s.engine_oom_score_adj,
        load_timeout_s=s.engine_load_timeout_s,
    )


def _sessions(s: ServeSettings, state_dir: Path) -> SessionService | None:
    """The stored conversations, when --sessions is on."""
    if not s.sessions:
        return None
    from slmguard.serve.sessions import FILENAME, SessionService, SessionStore

    return SessionService(SessionStore.open(state_dir / FILENAME))


def _liveness(ctx: ServeContext, s: ServeSettings, state_dir: Path) -> Liveness:
    """The stall detector and its canary."""
    from slmguard.serve.liveness import Liveness, LivenessSettings

    return Liveness(
        ctx,
        LivenessSettings(
            floor_s=s.stall_floor_s,
            factor=s.stall_factor,
            fixed_s=s.stall_timeout_s,
            canary_interval_s=s.canary_interval_s,
        ),
        state_dir=state_dir,
    )


def _serve(ctx: ServeContext, governor: Governor | None, *, state_dir: Path, rundir: Path) -> int:
    """Bind, announce, serve until stopped, then remove the engine's runtime directory."""
    from slmguard.serve.runner import bind_socket, open_fault_log
    from slmguard.serve.runner import run as run_server

    s, model, config = ctx.settings, ctx.model, ctx.engine.config
    sock = bind_socket(s.host, s.port)
    fault_file = open_fault_log(state_dir / "faults" / "front.log")
    log.warning(
        "serving %s on http://%s:%d with %s (n_ctx %d, %d slot(s), %d threads, queue %d)",
        model.id, s.host, s.port, ctx.engine_version, config.n_ctx_slot, config.n_parallel,
        config.n_threads, s.queue_size,
    )  # fmt: skip
    if model.note:
        log.warning("note: %s", model.note)
    try:
        return run_server(ctx, sock, governor)
    finally:
        if fault_file is not None:
            fault_file.close()
        with contextlib.suppress(OSError):
            if not os.environ.get("RUNTIME_DIRECTORY"):
                shutil.rmtree(rundir)
