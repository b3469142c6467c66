"""``slmguard serve``: an OpenAI-compatible front guarding a supervised llama-server child."""

from __future__ import annotations

import argparse
import logging

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


def run(args: argparse.Namespace) -> int:
    """Map the flags to the settings, build the server, say what it serves, run it."""
    from slmguard import settings
    from slmguard.plan.schema import load_plan
    from slmguard.serve.runner import bind_socket
    from slmguard.serve.server import build_server

    plan = load_plan(args.plan) if args.plan is not None else None
    s = settings.resolve(args, plan=plan)
    server = build_server(s, plan)
    sock = bind_socket(s.host, s.port)
    config = server.engine.config
    log.warning(
        "serving %s on http://%s:%d with %s (n_ctx %d, %d slot(s), %d threads, queue %d)",
        server.model.id, s.host, s.port, server.engine.version, config.n_ctx_slot,
        config.n_parallel, config.n_threads, s.queue_size,
    )  # fmt: skip
    if server.model.note:
        log.warning("note: %s", server.model.note)
    return server.run(sock)
