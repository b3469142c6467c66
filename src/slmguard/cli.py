"""The command line: the only place that prints to the terminal or exits.

Each verb lives in ``slmguard.commands.<verb>`` with ``register(subparsers)``
(adds its parser and sets ``run``) and ``run(args) -> int``. Verbs are found by
listing that package, so adding one touches no shared file. Library errors
become one ``slmguard: error:`` line (plus a hint) and the exit code of their
class (``slmguard.errors.EXIT_CODES``, the exit-code table of docs/cli.md).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from collections.abc import Sequence
from typing import NoReturn

from slmguard import __version__
from slmguard.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    SlmguardError,
    UsageError,
    exit_code,
)


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on usage errors; 2 means "failures" for doctor, so use 64."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(exit_code(UsageError), f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    import slmguard.commands as commands_pkg

    parser = _Parser(
        prog="slmguard",
        description="Keep small language models alive on 4-8 GB edge boards: "
        "plan the memory, audit the host, render a hardened deployment, "
        "serve with a memory governor, watch for OOM kills.",
    )
    parser.add_argument("--version", action="version", version=f"slmguard {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (repeatable)"
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    modules = []
    for info in pkgutil.iter_modules(commands_pkg.__path__):
        if not info.name.startswith("_"):
            modules.append(importlib.import_module(f"slmguard.commands.{info.name}"))
    for mod in sorted(modules, key=lambda m: (getattr(m, "ORDER", 50), m.__name__)):
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> NoReturn:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "run", None):
        parser.print_help(sys.stderr)
        sys.exit(exit_code(UsageError))
    try:
        code = int(args.run(args))
        sys.stdout.flush()  # a reader that went away fails here, not at exit
    except BrokenPipeError:
        code = _reader_gone()
    except SlmguardError as err:
        print(f"slmguard: error: {err.message}", file=sys.stderr)
        if err.hint:
            print(f"hint: {err.hint}", file=sys.stderr)
        code = exit_code(err)
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    sys.exit(code)


def _reader_gone() -> int:
    """stdout's reader closed the pipe (``slmguard doctor | head``): stop quietly, as
    a tool killed by SIGPIPE would, with no traceback when Python flushes at exit."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE
