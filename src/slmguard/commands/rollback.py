"""``slmguard rollback``: restore what apply changed, byte for byte."""

from __future__ import annotations

import argparse
from pathlib import Path

from slmguard.commands._deploy import print_commands

ORDER = 32


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "rollback",
        help="restore every file apply replaced and remove those it created",
        description="Undo `slmguard apply` under --root (default /) from its manifest: "
        "replaced files get their bytes, mode and owner back, created files and "
        "directories are removed, then the manifest. Sysctl values stay in effect until "
        "the next boot.\n\n"
        "Example:\n"
        "  slmguard rollback\n"
        "  slmguard rollback --root /mnt/board-image",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--root", type=Path, default=Path("/"), metavar="DIR", help="target root")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slmguard.deploy.rollback import rollback

    result = rollback(args.root)
    if result.nothing:
        print(f"nothing to roll back: no apply manifest under {args.root}")
        return 0
    for path in result.restored:
        print(f"restored {path}")
    for path in result.removed:
        print(f"removed {path}")
    for path in result.removed_dirs:
        print(f"removed directory {path}")
    for key in result.sysctls_restored:
        print(f"restored running {key}")
    print_commands(result.commands, result.failed_commands)
    return 0
