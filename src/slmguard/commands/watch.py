"""``slmguard watch``: the OOM / pressure / leak watchdog, as a daemon or once.

The flags and ``SLMGUARD_WATCH_*`` environment variables come from
:class:`slmguard.watch.config.WatchConfig` (each setting declared once there,
derived by :mod:`slmguard.options`); ``--plan`` supplies the memory lines,
environment variables override it and flags override both.
Exit status of ``--once``: 0 healthy, 1 warning, 2 critical (errors: the
table in ``slmguard.errors``).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ORDER = 60

EXAMPLES = """\
Example:
  slmguard watch --plan plan.json --unit slmguard.service --server http://127.0.0.1:8080 \\
      --admin-token-file /etc/slmguard/admin-token --webhook http://10.0.0.5:9000/alerts
  slmguard watch --once --json --cgroup /sys/fs/cgroup/system.slice/slmguard.service
  slmguard watch --collect --unit slmguard.service     # crash bundle now (OnFailure=)

Exit status with --once: 0 healthy, 1 warning, 2 critical.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from slmguard import options
    from slmguard.watch.config import ENV_PREFIX, WatchConfig

    p = sub.add_parser(
        "watch",
        help="watch the server: OOM kills, memory pressure, leaks; crash bundles",
        description="Watch a served model: report every kernel OOM kill once (the "
        "/dev/kmsg cursor survives restarts), compare the cgroup working set with its "
        "limit and call the trim API when it stays high, warn on memory pressure and "
        "on fd / DMA-BUF handle leaks, and write a crash bundle when the service is "
        "killed or dies.\n\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--plan", type=Path, default=None, help="plan file (memory lines, limit)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="poll once and exit 0/1/2")
    mode.add_argument(
        "--collect", action="store_true", help="write a crash bundle now and print its path"
    )
    p.add_argument("--json", action="store_true", help="JSON output")
    options.add_flags(p, WatchConfig, ENV_PREFIX)
    p.set_defaults(run=run)


def build_config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Any:
    from slmguard import options, paths
    from slmguard.errors import UsageError
    from slmguard.host import cgroup as cg
    from slmguard.plan.planfile import load_plan
    from slmguard.watch.config import ENV_PREFIX, WatchConfig, config_from_plan

    base: dict[str, Any] = {"state_dir": paths.state_dir()}
    if args.plan is not None:
        base.update(config_from_plan(load_plan(args.plan)))
    env = os.environ if env is None else env
    values = options.collect(WatchConfig, args, env, ENV_PREFIX, base)
    root = values.get("root", Path("/"))
    if values.get("cgroup") is None:
        if values.get("unit"):
            # Not running yet (or any more) is fine: the watcher looks again each poll.
            values["cgroup"] = cg.unit_cgroup_dir(root, values["unit"])
        elif values.get("pids"):
            values["cgroup"] = cg.memory_cgroup_dir(root, values["pids"][0])
    cgroup_dir = values.get("cgroup")
    if cgroup_dir is not None and not cg.is_cgroup_dir(Path(cgroup_dir)):
        raise UsageError(f"--cgroup {cgroup_dir}: not a cgroup directory")
    return WatchConfig(**values)


def _summary(result: Any, config: Any) -> dict[str, Any]:
    from slmguard.watch.rules import LEVEL_NAMES

    snap, d = result.snapshot, result.decision
    p = snap.pressure
    return {
        "level": LEVEL_NAMES[d.level],
        "level_code": d.level,
        "working_set_bytes": d.working_set_bytes,
        "limit_bytes": d.limit_bytes,
        "working_set_pct": None if d.working_set_pct is None else round(d.working_set_pct, 1),
        "cgroup": str(config.cgroup) if config.cgroup else None,
        "oom_kill_count": snap.cgroup.oom_kill_count if snap.cgroup else None,
        "psi_some_avg10_pct": p.some_avg10_pct if p else None,
        "psi_full_avg10_pct": p.full_avg10_pct if p else None,
        "fd_count": snap.fd_count,
        "dmabuf_handles": snap.dmabuf_count,
        "system_dmabuf_bytes": snap.system_dmabuf_bytes,
        "cma_total_bytes": snap.cma_total_bytes,
        "cma_free_bytes": snap.cma_free_bytes,
        "server": None
        if snap.health is None
        else {"url": snap.health.url, "status": snap.health.status, "error": snap.health.error},
        "kills": [
            {"pid": k.pid, "comm": k.comm, "scope": k.scope, "task_memcg": k.task_memcg}
            for k in snap.kills
        ],
        "alerts": [
            {"severity": a.severity, "kind": a.kind, "message": a.message} for a in d.alerts
        ],
        "bundle": str(result.bundle) if result.bundle else None,
        "errors": list(snap.errors),
    }


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 20):.0f} MiB"


def _print_human(s: dict[str, Any]) -> None:
    print(f"slmguard watch: {s['level']}")
    if s["working_set_bytes"] is not None:
        pct = f" ({s['working_set_pct']}%)" if s["working_set_pct"] is not None else ""
        limit = _mib(s["limit_bytes"]) if s["limit_bytes"] else "no limit"
        print(f"  working set {_mib(s['working_set_bytes'])} of {limit}{pct}")
    if s["oom_kill_count"] is not None:
        print(f"  cgroup oom_kill count {s['oom_kill_count']}")
    if s["psi_some_avg10_pct"] is not None:
        print(
            f"  memory pressure some {s['psi_some_avg10_pct']}% full {s['psi_full_avg10_pct']}%"
            " (avg10)"
        )
    if s["fd_count"] is not None:
        print(f"  open fds {s['fd_count']}, DMA-BUF handles {s['dmabuf_handles']}")
    if s["cma_total_bytes"]:
        print(f"  CMA free {_mib(s['cma_free_bytes'])} of {_mib(s['cma_total_bytes'])}")
    if s["server"] is not None:
        status = s["server"]["status"] or s["server"]["error"]
        print(f"  server {s['server']['url']}: {status}")
    for a in s["alerts"]:
        print(f"  {a['severity']}: {a['kind']}: {a['message']}")
    if s["bundle"]:
        print(f"  crash bundle: {s['bundle']}")
    for e in s["errors"]:
        print(f"  not read: {e}")


def run(args: argparse.Namespace) -> int:
    from slmguard.watch.daemon import Watcher

    config = build_config(args)
    with Watcher(config) as watcher:
        if args.collect:
            path = watcher.collect_recent("on-demand")
            print(json.dumps({"bundle": str(path)}) if args.json else path)
            return 0
        if args.once:
            result = watcher.poll()
            watcher.save()
            summary = _summary(result, config)
            if args.json:
                print(json.dumps(summary, indent=1))
            else:
                _print_human(summary)
            return int(result.decision.level)

        def on_poll(result: Any) -> None:
            # Alerts are logged (stderr, the journal under systemd) and appended to
            # alerts.jsonl; --json also prints them on stdout, one object a line.
            for a in result.decision.alerts:
                line = {"severity": a.severity, "kind": a.kind, "message": a.message}
                print(json.dumps(line), flush=True)

        watcher.run(on_poll=on_poll if args.json else None)
    return 0
