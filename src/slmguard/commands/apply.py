"""``slmguard apply``: install the deployment under a root, safely and repeatably."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slmguard.commands._deploy import (
    add_model_argument,
    add_unit_arguments,
    copy_progress,
    plan_path,
    planned_model,
    print_commands,
    unit_options,
)

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
        "it as <secret, N bytes>. The model (the plan's file, or --model FILE, which a "
        "plan made with --preset needs) is checked against the plan (size and sha256, or "
        "architecture and layers for a preset) and installed as "
        "/var/lib/slmguard-models/NAME (a hard link when it may be, else a copy); the "
        "installed /etc/slmguard/plan.json names it. Files an earlier apply created that "
        "the deployment no longer has (a dropped --protect drop-in) are removed. The "
        "deployment it replaces is kept (`slmguard rollback --to previous` returns to it "
        "byte for byte), and a model file it hashed is not read again while its size, "
        "inode and mtime stay the same. On / it "
        "then runs `sysctl --system` and `systemctl daemon-reload` where they exist; it "
        "does not start the services.\n\n"
        "Example:\n"
        "  slmguard apply --plan plan.json --dry-run      # show the diff, write nothing\n"
        "  slmguard apply --plan plan.json --protect mosquitto.service\n"
        "  slmguard apply --plan qwen-preset.json --model qwen2.5-1.5b-instruct-q4_k_m.gguf\n"
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
    add_model_argument(p)
    add_unit_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slmguard.deploy.apply import apply_plan
    from slmguard.deploy.digests import load_digests
    from slmguard.deploy.escape import shell_word
    from slmguard.deploy.modelfile import board_models
    from slmguard.deploy.rootpath import check_root
    from slmguard.plan.schema import load_plan

    check_root(args.root)
    plan = load_plan(plan_path(args, args.root))
    digests = load_digests(args.root)
    model = planned_model(args, plan, args.root, digests)
    others = board_models(plan, args.root, copy_progress("checking a model's sha256"), digests)
    result = apply_plan(
        plan,
        unit_options(args),
        args.root,
        model=model,
        dry_run=args.dry_run,
        progress=copy_progress(f"copying {model.source}"),
        digests=digests,
        others=others,
    )
    if result.dry_run:
        sys.stdout.write(result.diff)
    for note in result.notes:
        print(f"note: {note}")
    n = len(result.changes) + len(result.removals)
    if not n:
        done = " (the apply that had stopped midway is marked finished)" if result.finished else ""
        print(f"nothing to change: {args.root} already matches the plan{done}")
        return 0
    if result.dry_run:
        print(f"dry run: {n} files would change under {args.root}")
        return 0
    for c in result.changes:
        m = c.file.model
        how = f" ({result.model_installs.get(c.path)} of {m.source})" if m is not None else ""
        print(f"{c.action}d {c.path}{how}")
    for r in result.removals:
        print(f"removed {r.path} (an earlier apply's, no longer in the deployment)")
    root = shell_word(str(args.root))
    print(f"{n} files changed; undo with: slmguard rollback --root {root}")
    if result.previous_kept:
        print(f"previous plan kept: slmguard rollback --to previous --root {root} goes back to it")
    print(f"manifest: {result.manifest}")
    print_commands(result.commands, result.failed_commands)
    return 0
