"""``slmguard apply``: install the deployment under a root, safely and repeatably.

``--json`` prints one JSON object (:data:`RESULT_SCHEMA`) on stdout whatever
happens, for an orchestrator that must decide from facts: whether this run
changed a file under the root (on a failure too: apply's manifest changed or
not), the plan and rollout before and after, the paths, the exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slmguard.commands._deploy import (
    add_model_argument,
    add_unit_arguments,
    board_models,
    copy_progress,
    plan_path,
    planned_model,
    print_commands,
    unit_options,
)
from slmguard.errors import UsageError

if TYPE_CHECKING:
    from slmguard.deploy.render import RenderOptions

if TYPE_CHECKING:
    from slmguard.deploy.apply import ApplyResult
    from slmguard.deploy.modelfile import ModelSource

ORDER = 31
RESULT_SCHEMA = "slmguard.apply-result/1"


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
        "the deployment no longer has are removed. Without --protect, the services the "
        "deployment in place protects stay protected (--no-protect drops them; --protect "
        "names the whole list). The "
        "deployment it replaces is kept (`slmguard rollback --to previous` returns to it "
        "byte for byte), and a model file it hashed is not read again while its size, "
        "inode and mtime stay the same. On / it "
        "then runs `sysctl --system` and `systemctl daemon-reload` where they exist; it "
        "does not start the services.\n\n"
        "Example:\n"
        "  slmguard apply --plan plan.json --dry-run      # show the diff, write nothing\n"
        "  slmguard apply --plan plan.json --protect mosquitto.service\n"
        "  slmguard apply --plan qwen-preset.json --model qwen2.5-1.5b-instruct-q4_k_m.gguf\n"
        "  slmguard apply --plan plan.json --rollout 2026-12-06-canary --json\n"
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
    p.add_argument(
        "--rollout",
        default=None,
        metavar="ID",
        help="label the deployment this apply makes with a fleet rollout's id "
        "([A-Za-z0-9._:+-], at most 64): `rollback --to previous --rollout ID` undoes only "
        "that rollout's move; an apply that changes nothing records nothing",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout, also when apply fails: changed (a file under "
        "the root written or removed by this run), exit, the plan's sha256 and the rollout "
        "before and after, the paths, notes (the diff of --dry-run is not printed)",
    )
    p.add_argument(
        "--no-protect",
        action="store_true",
        help="protect no service: without --protect, apply keeps the services the "
        "deployment in place protects; this drops them",
    )
    add_model_argument(p)
    add_unit_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.json:
        result, model = _apply(args)
        return _print_lines(args, result, model)
    stamp = _manifest_stamp(args.root)
    try:
        result, model = _apply(args)
    except BaseException as err:
        print(json.dumps(_failure_json(args, err, stamp), indent=1), flush=True)
        raise
    print(json.dumps(_result_json(args, result, model), indent=1))
    return 0


def _apply(args: argparse.Namespace) -> tuple[ApplyResult, ModelSource]:
    from slmguard.deploy.apply import apply_plan
    from slmguard.deploy.digests import load_digests
    from slmguard.deploy.rootpath import check_root
    from slmguard.plan.planfile import load_plan

    check_root(args.root)
    plan = load_plan(plan_path(args, args.root))
    digests = load_digests(args.root)
    model = planned_model(args, plan, args.root, digests)
    others = board_models(args, plan, args.root, digests)
    result = apply_plan(
        plan,
        _unit_options_kept(args),
        args.root,
        model=model,
        dry_run=args.dry_run,
        progress=copy_progress(f"copying {model.source}"),
        digests=digests,
        others=others,
        rollout=args.rollout,
    )
    return result, model


def _manifest_stamp(root: Path) -> tuple[int, int, int] | None:
    """apply's manifest as it is now (inode, size, mtime): written atomically before the first
    target is touched, so a different stamp after a failure means this run wrote."""
    from slmguard.deploy.manifest import MANIFEST_NAME, apply_dir

    try:
        st = os.stat(apply_dir(root) / MANIFEST_NAME)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _failure_json(args: argparse.Namespace, err: BaseException, before: Any) -> dict[str, Any]:
    from slmguard.errors import SlmguardError, exit_code

    if isinstance(err, SlmguardError):
        code, message, hint = exit_code(err), err.message, err.hint
    elif isinstance(err, KeyboardInterrupt):
        from slmguard.errors import EXIT_INTERRUPTED

        code, message, hint = EXIT_INTERRUPTED, "interrupted", None
    else:
        code, message, hint = 1, f"{type(err).__name__}: {err}", None
    return {
        "schema": RESULT_SCHEMA,
        "exit": code,
        "root": str(args.root),
        "changed": _manifest_stamp(args.root) != before,
        "error": message,
        "hint": hint,
    }


def _result_json(
    args: argparse.Namespace, result: ApplyResult, model: ModelSource
) -> dict[str, Any]:
    installed = any(c.file.is_model for c in result.changes)
    return {
        "schema": RESULT_SCHEMA,
        "exit": 0,
        "root": str(args.root),
        "changed": result.changed and not result.dry_run,
        "dry_run": result.dry_run,
        "would_change": result.changed if result.dry_run else None,
        "finished_earlier_apply": result.finished,
        "plan_sha256_before": result.plan_sha256_before,
        "plan_sha256_after": result.plan_sha256_after,
        "rollout_before": result.rollout_before,
        "rollout_after": result.rollout_after,
        "changes": [{"action": c.action, "path": c.path} for c in result.changes],
        "removed": [r.path for r in result.removals],
        "model": {
            "path": model.dest,
            "sha256": model.sha256,
            "bytes": model.size_bytes,
            "installed": installed and not result.dry_run,
            "install": result.model_install,
        },
        "next_boot": list(result.reboot_paths),
        "notes": list(result.notes),
        "manifest": None if result.manifest is None else str(result.manifest),
        "previous_kept": result.previous_kept,
        "commands": [list(c) for c in result.commands],
        "failed_commands": list(result.failed_commands),
    }


def _print_lines(args: argparse.Namespace, result: ApplyResult, model: ModelSource) -> int:
    from slmguard.deploy.escape import shell_word

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
        print(f"dry run: {_files(n)} would change under {args.root}")
        return 0
    for c in result.changes:
        m = c.file.model
        how = f" ({result.model_installs.get(c.path)} of {m.source})" if m is not None else ""
        print(f"{c.action}d {c.path}{how}")
    for r in result.removals:
        print(f"removed {r.path} (an earlier apply's, no longer in the deployment)")
    root = shell_word(str(args.root))
    print(f"{_files(n)} changed; undo with: slmguard rollback --root {root}")
    if result.previous_kept:
        print(f"previous plan kept: slmguard rollback --to previous --root {root} goes back to it")
    print(f"manifest: {result.manifest}")
    print_commands(result.commands, result.failed_commands)
    return 0


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def _unit_options_kept(args: argparse.Namespace) -> RenderOptions:
    """The unit options of the flags; without --protect (or --no-protect), the services
    the deployment in place protects, so that a new plan does not drop them."""
    from slmguard.deploy.apply import protected_services

    if args.no_protect and args.protect:
        raise UsageError("--no-protect and --protect contradict each other: give one")
    opts = unit_options(args)
    if args.protect or args.no_protect:
        return opts
    kept = protected_services(args.root)
    if kept:
        print(
            f"note: keeping --protect {' '.join(kept)} from the deployment in place "
            "(--no-protect drops it)"
        )
    return replace(opts, protect=kept)
