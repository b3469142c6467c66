"""``slmguard rollback``: restore what apply changed, byte for byte (or go back one plan)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slmguard.commands._deploy import print_commands

if TYPE_CHECKING:
    from slmguard.deploy.rollback import RollbackResult

ORDER = 32
TO = ("nothing", "previous")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "rollback",
        help="restore every file apply replaced and remove those it created (or go back one "
        "plan with --to previous)",
        description="Undo `slmguard apply` under --root (default /) from its manifest.\n\n"
        "--to nothing (the default): back to before the first apply. Replaced files get "
        "their bytes, mode and owner back, created files and directories are removed, then "
        "the manifest. Sysctl values stay in effect until the next boot.\n\n"
        "--to previous: back one plan, to the deployment the last apply replaced, byte for "
        "byte (the plan, the units, the model from its kept hard link); after the first "
        "apply that is the state before it. Restart the services afterwards (the Ansible "
        "role does). Going back twice is refused: run apply with the plan you want.\n\n"
        "--rollout ID (with --to previous): go back only when rollout ID (`apply --rollout`) "
        "made the deployment in place; any other board is left as it is, nothing written: "
        "how a fleet undoes one rollout.\n\n"
        "--if-unfinished: only when the last apply did not finish (a power cut or a kill "
        "stopped it midway): back to the last deployment that finished, as --to previous "
        "goes, and removes the temporaries its cut writes left (.NAME.slmguard-tmp-PID); "
        "nothing otherwise. slmguard-recover.service runs it at every boot, before "
        "the services start.\n\n"
        "--dry-run checks the manifest and every backup as a rollback does and prints "
        "what it would restore, remove and run, writing nothing.\n\n"
        "Example:\n"
        "  slmguard rollback --dry-run                    # what would be restored\n"
        "  slmguard rollback --to previous && systemctl restart slmguard.service\n"
        "  slmguard rollback\n"
        "  slmguard rollback --root /mnt/board-image\n"
        "  slmguard rollback --to previous --rollout 3f2a9c0d1e7b4a65 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--root", type=Path, default=Path("/"), metavar="DIR", help="target root")
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--to",
        choices=TO,
        default="nothing",
        help="nothing: before the first apply (default); previous: the plan before the last apply",
    )
    what.add_argument(
        "--if-unfinished",
        action="store_true",
        help="only when the last apply did not finish: back to the last one that did",
    )
    p.add_argument(
        "--rollout",
        default=None,
        metavar="ID",
        help="with --to previous: only when rollout ID made the deployment in place",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (what changed, the plan now in place) instead of lines",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print what it would restore, remove and run; write nothing",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slmguard.deploy.rollback import rollback, rollback_previous, rollback_unfinished
    from slmguard.errors import UsageError

    if args.rollout is not None and args.to != "previous":
        raise UsageError("--rollout goes with --to previous")
    if args.if_unfinished and args.dry_run:
        raise UsageError("--if-unfinished runs at boot; --dry-run goes with --to")
    if args.if_unfinished:
        result = rollback_unfinished(args.root)
    elif args.to == "previous":
        result = rollback_previous(args.root, rollout=args.rollout, dry_run=args.dry_run)
    else:
        result = rollback(args.root, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(_result_json(result, args), indent=1))
        return 0
    if args.if_unfinished:
        if result.nothing and not result.no_previous:
            print(f"nothing to undo: the last apply under {args.root} finished (or none ran)")
            return 0
        print(f"the last apply under {args.root} did not finish: going back to the last "
              "deployment that did")  # fmt: skip
    if result.not_this_rollout:
        print(
            f"nothing to roll back: rollout {args.rollout} did not make the deployment under "
            f"{args.root} (rollout {result.other_rollout or 'none'} did)"
        )
        return 0
    if result.no_previous:
        print(
            f"nothing to roll back: {args.root} is on the plan apply found there already "
            "(the previous plan was gone back to, or never kept); apply the plan you want"
        )
        return 0
    if result.nothing:
        print(f"nothing to roll back: no apply manifest under {args.root}")
        return 0
    would = "would be " if result.dry_run else ""
    for path in result.restored:
        print(f"{would}restored {path}")
    for path in result.removed:
        print(f"{would}removed {path}")
    for path in result.removed_dirs:
        print(f"{would}removed directory {path}")
    for key in result.sysctls_restored:
        print(f"{would}restored running {key}")
    if result.dry_run:
        for cmd in result.commands:
            print(f"would run: {' '.join(cmd)}")
    else:
        print_commands(result.commands, result.failed_commands)
    if args.to == "previous" or args.if_unfinished:
        where = (
            "the state before the first apply (that was the only plan)"
            if result.to_initial
            else f"the previous plan (plan.json sha256 {result.plan_sha256 or 'unknown'})"
        )
        print(f"{'would be ' if result.dry_run else ''}back on {where}")
    if result.dry_run:
        n = len(result.restored) + len(result.removed)
        print(
            f"dry run: {n} {'file' if n == 1 else 'files'} would change under {args.root}; "
            "nothing written"
        )
    return 0


def _result_json(result: RollbackResult, args: argparse.Namespace) -> dict[str, Any]:
    """``--json``: what went back; ``changed`` is whether a file under the root was touched."""
    changed = not result.dry_run and bool(result.restored or result.removed or result.removed_dirs)
    return {
        "schema": "slmguard.rollback-result/1",
        "root": str(args.root),
        "to": args.to,
        "if_unfinished": args.if_unfinished,
        "unfinished": result.unfinished,
        "dry_run": result.dry_run,
        "changed": changed,
        "restored": list(result.restored),
        "removed": list(result.removed) + list(result.removed_dirs),
        "sysctls_restored": list(result.sysctls_restored),
        "no_manifest": result.nothing and not (result.no_previous or result.not_this_rollout),
        "no_previous": result.no_previous,
        "not_this_rollout": result.not_this_rollout,
        "rollout_in_place": result.other_rollout if result.not_this_rollout else None,
        "plan_sha256": result.plan_sha256,
        "to_initial": result.to_initial,
        "commands": [list(c) for c in result.commands],
        "failed_commands": list(result.failed_commands),
    }
