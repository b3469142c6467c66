"""``slmguard top``: the live view (a terminal UI), or one snapshot with ``--once``.

The flags and ``SLMGUARD_TOP_*`` variables come from
:class:`slmguard.top.config.TopConfig`. The terminal UI needs the ``top`` extra
(textual); ``--once`` needs nothing beyond slmguard itself. Exit status:
0, or 69 when the UI library is missing (interactive) or the server did not
answer (``--once``; the snapshot is still printed); other errors as in the
table of docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

ORDER = 65

EXAMPLES = """\
Example:
  slmguard top                                    # the server on 127.0.0.1:8080, this board
  slmguard top --plan /etc/slmguard/plan.json --admin-token-file /etc/slmguard/admin-token
  slmguard top --once                             # one snapshot as text (bug reports)
  slmguard top --once --json | jq .server.governor
  slmguard top --server http://board.local:8080 --api-key-file key  # remote: no board

Keys: q quit, p pause, t trim contexts (admin token; asks first), ? help.
Exit status: 0; with --once 69 when the server did not answer; 69 without
the UI library (in a clone: .venv/bin/pip install -e '.[top]').
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from slmguard import options
    from slmguard.top.config import ENV_PREFIX, TopConfig

    p = sub.add_parser(
        "top",
        help="live view: memory against the limits, governor, engine slots, board, events",
        description="The live view of a served model: the service's working set against "
        "MemoryHigh/MemoryMax and the governor's watermarks, the plan's parts planned vs "
        "measured, PSI and cgroup memory events, the governor's level and transitions, "
        "the engine's slots, speeds and restarts, CPU/thermal/NPU load of the board, and a "
        "timeline of OOM kills, restarts, stalls and crash bundles.\n\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="with --once: the snapshot as JSON")
    options.add_flags(p, TopConfig, ENV_PREFIX)
    p.set_defaults(run=run)


def build(args: argparse.Namespace, env: Any = None) -> tuple[Any, Any]:
    """(config, collector) from the flags and the environment."""
    from slmguard import options, paths
    from slmguard.errors import UsageError
    from slmguard.plan.planfile import load_plan
    from slmguard.top.client import ServerClient
    from slmguard.top.config import ENV_PREFIX, TopConfig, admin_token_path, api_key, read_token
    from slmguard.top.sources import Collector, plan_view

    env = os.environ if env is None else env
    if args.json and not args.once:
        raise UsageError("--json needs --once (the live view is a terminal UI)")
    values = options.collect(TopConfig, args, env, ENV_PREFIX)
    config = TopConfig(**values)
    if config.cgroup is not None and not (config.cgroup / "cgroup.procs").exists():
        raise UsageError(f"--cgroup {config.cgroup}: not a cgroup directory")
    token_path = admin_token_path(config, env)
    client = ServerClient(
        config.server_url,
        api_key=api_key(config, env),
        admin_token=read_token(token_path) if token_path else None,
        timeout_s=config.http_timeout_s,
    )
    loaded = load_plan(config.plan) if config.plan else None
    plan = plan_view(loaded, config.plan) if loaded is not None and config.plan else None
    collector = Collector(
        client,
        root=config.root,
        local=config.local,
        cgroup_dir=config.cgroup,
        unit=config.unit,
        state_dir=config.state_dir or paths.state_dir(env),
        plan=plan,
        tuning_plan=loaded,
        max_events=config.events,
    )
    return config, collector


def snapshot_once(collector: Any, settle_s: float) -> Any:
    """Two refreshes ``settle_s`` apart (CPU load and rates need two reads); the second."""
    collector.poll()
    time.sleep(settle_s)
    return collector.poll()


def run(args: argparse.Namespace) -> int:
    from slmguard.errors import EngineUnavailableError

    config, collector = build(args)
    if args.once:
        from slmguard.top.text import render_json, render_screen
        from slmguard.top.view import build_screen

        snap = snapshot_once(collector, min(config.interval_s, 1.0))
        print(render_json(snap) if args.json else render_screen(build_screen(snap)), end="")
        return 0 if snap.server.reachable else 69
    try:
        from slmguard.top import app
    except ImportError as err:
        # Name the extra, not the module that failed first (app imports rich before
        # textual, and rich is only textual's dependency).
        raise EngineUnavailableError(
            "the terminal UI library textual (the `top` extra)",
            hint="in a clone: .venv/bin/pip install -e '.[top]'; from a wheel: pip install "
            "'slmguard-VERSION-py3-none-any.whl[top]' (slmguard is on no package index; the "
            "Debian package has it); or use `slmguard top --once` (plain text)",
        ) from err
    return int(
        app.run(
            collector,
            interval_s=config.interval_s,
            keep_recent=config.keep_recent,
            can_trim=collector.client.admin_token is not None,
        )
    )
