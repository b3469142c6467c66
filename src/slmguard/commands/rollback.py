"""``slmguard rollback``: restore what apply changed, byte for byte (or go back one plan)."""

from __future__ import annotations

import argparse
from pathlib import Path

from slmguard.commands._deploy import print_commands

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
        "--dry-run checks the manifest and every backup as a rollback does and prints "
        "what it would restore, remove and run, writing nothing.\n\n"
        "Example:\n"
        "  slmguard rollback --dry-run                    # what would be restored\n"
        "  slmguard rollback --to previous && systemctl restart slmguard.service\n"
        "  slmguard rollback\n"
        "  slmguard rollback --root /mnt/board-image",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--root", type=Path, default=Path("/"), metavar="DIR", help="target root")
    p.add_argument(
        "--to",
        choices=TO,
        default="nothing",
        help="nothing: before the first apply (default); previous: the plan before the last apply",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print what it would restore, remove and run; write nothing",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slmguard.deploy.rollback import rollback, rollback_previous

    go = rollback_previous if args.to == "previous" else rollback
    result = go(args.root, dry_run=args.dry_run)
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
    if args.to == "previous":
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
