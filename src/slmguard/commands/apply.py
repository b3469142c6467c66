"""``slmguard apply``: install the deployment under a root, safely and repeatably."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slmguard.commands._deploy import add_unit_arguments, plan_path, print_commands, unit_options

ORDER = 31


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "apply",
        help="install the units, slices, sysctl, swap/zram and boot settings of a plan",
        description="Write the deployment the plan describes under --root (default /): "
        "each file atomically, after saving what it replaces in a manifest (rollback "
        "restores it byte for byte). Refuses before writing anything when the plan does "
        "not fit the board or a boot file cannot be parsed. A second apply of the same "
        "plan changes nothing. The admin token /etc/slmguard/admin-token (for the "
        "watcher's trim calls) is generated once, mode 0600, when missing; diffs show "
        "it as <secret, N bytes>. On / it then runs `sysctl --system` and "
        "`systemctl daemon-reload` where they exist; it does not start the services.\n\n"
        "Example:\n"
        "  slmguard apply --plan plan.json --dry-run      # show the diff, write nothing\n"
        "  slmguard apply --plan plan.json --protect mosquitto.service\n"
        "  systemctl start slmguard.service slmguard-watch.service",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--plan",
        type=Path,
        default=None,
        metavar="FILE",
        help="the plan (default: /etc/slmguard/plan.json from an earlier apply)",
    )
    p.add_argument("--root", type=Path, default=Path("/"), metavar="DIR", help="target root")
    p.add_argument("--dry-run", action="store_true", help="print a unified diff, write nothing")
    add_unit_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slmguard.deploy.apply import apply_plan
    from slmguard.deploy.escape import shell_word
    from slmguard.plan.schema import load_plan

    plan = load_plan(plan_path(args, args.root))
    result = apply_plan(plan, unit_options(args), args.root, dry_run=args.dry_run)
    if result.dry_run:
        sys.stdout.write(result.diff)
    for note in result.notes:
        print(f"note: {note}")
    if not result.changes:
        print(f"nothing to change: {args.root} already matches the plan")
        return 0
    if result.dry_run:
        print(f"dry run: {len(result.changes)} files would change under {args.root}")
        return 0
    for c in result.changes:
        print(f"{c.action}d {c.path}")
    undo = f"slmguard rollback --root {shell_word(str(args.root))}"
    print(f"{len(result.changes)} files changed; undo with: {undo}")
    print(f"manifest: {result.manifest}")
    print_commands(result.commands, result.failed_commands)
    return 0
