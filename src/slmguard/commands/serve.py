"""``slmguard serve``: the OpenAI-compatible server with a supervised engine worker."""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import logging
from pathlib import Path

ORDER = 40

log = logging.getLogger(__name__)

EXAMPLE = """\
Example:
  slmguard serve                                  # default model on 127.0.0.1:8080
  slmguard serve --model qwen2.5-0.5b-q4_k_m.gguf --n-ctx 4096 --port 9000
  slmguard serve --plan plan.json --host 0.0.0.0 --api-key-file /etc/slmguard/key
  curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "gemma-3-270m-q4_k_m", "messages": [{"role": "user", "content": "Hi"}]}'

Every option can also be set as an environment variable: --n-ctx is SLMGUARD_N_CTX.
With --plan, serve serves the plan's model file after checking its size and sha256
(--model FILE instead: for a file plan, the same size and sha256; for a preset plan, the
preset's architecture, layers and trained context); a preset plan needs --model.
Exit status: 0 stopped, 64 usage, 65 model unusable or not the planned file, 66 model
missing, 69 engine or web stack not installed, 70 engine kept dying, 78 bad settings or
plan, a preset plan without --model, or an unsafe bind.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from slmguard.settings import add_arguments

    p = sub.add_parser(
        "serve",
        help="serve a GGUF model over an OpenAI-compatible HTTP API",
        description="Serve a GGUF model over an OpenAI-compatible HTTP API. The engine runs "
        "in a worker process that the server restarts when it dies (OOM kill, crash); "
        "the server itself binds 127.0.0.1 unless an API key is set.\n\n" + EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(run=run)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _require(module: str, component: str) -> None:
    from slmguard.errors import EngineUnavailableError

    if importlib.util.find_spec(module) is None:
        raise EngineUnavailableError(component)


def run(args: argparse.Namespace) -> int:
    from slmguard import paths, settings
    from slmguard.errors import UnsafeBindError
    from slmguard.plan.schema import load_plan
    from slmguard.serve.modelcheck import probe_model

    plan = load_plan(args.plan) if args.plan is not None else None
    s = settings.resolve(args, plan=plan)
    state_dir = s.state_dir or paths.state_dir()
    planned = None
    if plan is not None:  # the plan's model (or --model checked against it): 65/66/78 now
        from slmguard.plan.model import model_for_plan

        planned = model_for_plan(plan, s.model, state_dir=state_dir).path
    key = settings.api_key(s)
    if not is_loopback(s.host) and not key:
        raise UnsafeBindError(s.host)
    admin = settings.admin_token(s)
    for module, component in (
        ("fastapi", "the web stack (fastapi)"),
        ("uvicorn", "the web stack (uvicorn)"),
        ("prometheus_client", "prometheus-client"),
        ("llama_cpp", "the engine (llama-cpp-python)"),
    ):
        _require(module, component)

    if planned is not None:
        model_path = Path(planned)
    elif s.model is not None:
        model_path = s.model
    else:
        from slmguard.default_model import ensure_default_model

        model_path = ensure_default_model(paths.model_dir())
    facts = probe_model(Path(model_path))

    from slmguard.serve.admission import EngineQueue
    from slmguard.serve.app import ServeContext
    from slmguard.serve.protocol import EngineConfig
    from slmguard.serve.runner import bind_socket
    from slmguard.serve.runner import run as run_server
    from slmguard.serve.supervisor import RestartPolicy, Supervisor, worker_fault_log
    from slmguard.serve.templates import Template

    config = EngineConfig(
        model_path=str(Path(model_path).resolve()),
        n_ctx=s.n_ctx,
        n_batch=s.n_batch,
        n_ubatch=s.n_ubatch,
        n_threads=s.n_threads or settings.default_threads(),
        kv_type=s.kv_type,
        use_mmap=s.use_mmap,
        use_mlock=s.use_mlock,
    )
    policy = RestartPolicy(
        backoff_initial_s=s.restart_backoff_initial_s,
        backoff_max_s=s.restart_backoff_max_s,
        max_restarts=s.restart_max,
        window_s=s.restart_window_s,
    )
    supervisor = Supervisor(
        config,
        policy,
        fault_log=worker_fault_log(state_dir),
        worker_oom_score_adj=s.worker_oom_score_adj,
    )
    ctx = ServeContext(
        settings=s,
        supervisor=supervisor,
        queue=EngineQueue(s.queue_size),
        model_id=s.model_name or Path(model_path).name.removesuffix(".gguf"),
        model_path=config.model_path,
        template=Template(arch=facts.arch, jinja=facts.chat_template),
        api_key=key,
        admin_token=admin,
    )
    governor = None
    if s.governor:
        from slmguard.governor.serving import build_governor, install

        governor = build_governor(
            ctx, plan=plan, facts=facts, state_dir=state_dir, budget_bytes=s.memory_budget_bytes
        )
        install(ctx, governor)
    sock = bind_socket(s.host, s.port)
    from slmguard.serve.runner import open_fault_log

    fault_file = open_fault_log(state_dir / "faults" / "front.log")
    log.warning(
        "serving %s on http://%s:%d (n_ctx %d, %d threads, queue %d)",
        ctx.model_id, s.host, s.port, s.n_ctx, config.n_threads, s.queue_size,
    )  # fmt: skip
    try:
        return run_server(ctx, sock, governor)
    finally:
        if fault_file is not None:
            fault_file.close()
