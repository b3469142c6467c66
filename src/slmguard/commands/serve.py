"""``slmguard serve``: an OpenAI-compatible front guarding a supervised llama-server child."""

from __future__ import annotations

import argparse
import logging

ORDER = 40

log = logging.getLogger(__name__)

EXAMPLE = """\
Example:
  slmguard serve                                  # default model on 127.0.0.1:8080
  slmguard serve --model qwen2.5-0.5b-instruct-q4_k_m.gguf --ctx 8192 --n-parallel 4
  slmguard serve --plan plan.json --host 0.0.0.0 --api-key-file /etc/slmguard/key
  slmguard serve --llama-server /opt/llama.cpp/build/bin/llama-server   # the board's build
  curl -s localhost:8080/v1/completions -H 'content-type: application/json' \\
    -d '{"model": "gemma-3-270m-q4_k_m", "prompt": "The capital of France is"}'

The embedded default model is a base (pretrained) model: it continues text well, but
its chat answers are nonsense. Chat with an instruction-tuned GGUF (--model).
Without --plan, serve plans for this host as `slmguard plan` does (slots, context per
slot, flash attention, batch) and logs what it chose; --ctx (tokens per slot, as in
`plan --ctx`), --n-parallel, --flash-attn, --kv-unified and --cache-ram-mib are honoured or
refused (78, with the numbers) before the engine starts. --n-ctx (the total of all slots)
is deprecated: use --ctx. A chat request without max_tokens gets --default-max-tokens.
Every option can also be set as an environment variable: --ctx is SLMGUARD_CTX.
With --plan, serve serves the plan's model file after checking its size and sha256
(--model FILE instead: for a file plan, the same size and sha256; for a preset plan, the
preset's architecture, layers and trained context); a preset plan needs --model.
Flags over a plan's memory settings (--ctx, --n-parallel, --n-batch, --n-ubatch, --kv-type,
--flash-attn, --kv-unified, --swa-full, --cache-ram-mib, --use-mmap, --use-mlock,
--n-threads) are re-budgeted with the planner's arithmetic against the plan's limits
(without --plan, those of the plan made for this host): refused (78, the MiB against the
plan's recovery line or CommitLimit and the largest --ctx that fits) or logged.
Exit status: 0 stopped, 64 usage, 65 model unusable, not the planned file, or the engine
cannot load it, 66 model missing, 69 engine binary or web stack not installed, 70 engine
kept dying, 78 bad settings or plan, a context beyond the model's trained context or this
host's memory, flags over a plan that its limits cannot hold, a preset plan without
--model, a GPU plan on an engine binary without its backend (`--list-devices`), or an
unsafe bind.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from slmguard.options import HelpFormatter
    from slmguard.settings import add_arguments

    p = sub.add_parser(
        "serve",
        help="serve a GGUF model over an OpenAI-compatible HTTP API",
        description="Serve a GGUF model over an OpenAI-compatible HTTP API. The engine is "
        "llama.cpp's llama-server, run as a child process the server restarts when it dies "
        "(OOM kill, crash) and guards with a memory governor; the server itself binds "
        "127.0.0.1 unless an API key is set.\n\n" + EXAMPLE,
        formatter_class=HelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Map the flags to the settings, build the server (planned for this host without
    --plan), say what it serves, run it."""
    import os

    from slmguard import settings
    from slmguard.plan.planfile import load_plan
    from slmguard.serve.runner import bind_socket
    from slmguard.serve.server import build_server

    _log_levels(getattr(args, "verbose", 0))
    for message in settings.deprecations(args, os.environ):
        log.warning("%s", message)
    plan = load_plan(args.plan) if args.plan is not None else None
    s = settings.resolve(args, plan=plan)  # flags and environment checked first (78)
    server = build_server(s, plan)
    sock = bind_socket(s.host, s.port)
    config = server.engine.config
    log.info(
        "starting %s with %s (%d slot(s) x %d tokens of context, %d threads, queue %d)",
        server.model.id, server.engine.version, config.n_parallel, config.n_ctx_slot,
        config.n_threads, s.queue_size,
    )  # fmt: skip
    for other in list(server.models)[1:]:
        cfg, kept = other.engine.config, other.residency
        log.info(
            "beside it %s (%s, priority %d): %d slot(s) x %d tokens of context",
            other.name, kept.residency.replace("_", "-"), kept.priority, cfg.n_parallel,
            cfg.n_ctx_slot,
        )  # fmt: skip
    if server.model.note:
        log.warning("note: %s", server.model.note)
    from slmguard.serve.app import create_app  # the web stack: checked above (69)

    return server.run(sock, create_app(server))


def _log_levels(verbose: int) -> None:
    """The front's own lines (the plan, ready, restarts) at INFO are shown by default;
    the engine's (logger ``slmguard.engine``) only with -v (its warnings) or -vv (all)."""
    logging.getLogger("slmguard").setLevel(logging.DEBUG if verbose >= 2 else logging.INFO)
    engine = (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]
    logging.getLogger("slmguard.engine").setLevel(engine)
