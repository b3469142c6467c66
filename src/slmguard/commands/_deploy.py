"""What ``render``, ``apply`` and ``rollback`` share: arguments, the plan, command output.

Owns the ``--protect``/``--business-slice``/``--exec`` arguments and the unit
options built from them, ``--model`` and the model check, finding the plan
(``--plan`` or the one an earlier apply installed under the root), the copy
progress and how the host commands apply and rollback ran are reported. A
module of ``slmguard.commands`` whose name starts with ``_``, so the CLI does
not take it for a verb.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from slmguard.deploy.render import PLAN_PATH, RenderOptions
from slmguard.deploy.units import LOOPBACK, PORT
from slmguard.errors import UsageError

if TYPE_CHECKING:
    from slmguard.deploy.digests import Digests
    from slmguard.deploy.modelfile import ModelSource
    from slmguard.plan.schema import Plan

DEFAULT_EXEC = "/usr/local/bin/slmguard"


def add_unit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--protect",
        action="append",
        default=[],
        metavar="NAME.service",
        help="move this existing service into the business protection slice (repeatable)",
    )
    p.add_argument(
        "--business-slice",
        default="business.slice",
        metavar="NAME.slice",
        help="name of the business protection slice (default: business.slice)",
    )
    p.add_argument(
        "--exec",
        dest="exec_path",
        default=None,
        metavar="PATH",
        help="the slmguard executable the units run (default: the one running now)",
    )
    p.add_argument(
        "--listen",
        default=None,
        metavar="ADDRESS[:PORT]",
        help="where the server listens (default 127.0.0.1:8080); another address is a LAN "
        "listener: the unit then passes an API key apply makes on the board "
        "(/etc/slmguard/api-key, 0600) and lets in only localhost and --allow",
    )
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="NETWORK",
        help="a network a LAN listener lets in (IPAddressAllow=, e.g. 10.20.0.0/16; repeatable)",
    )
    p.add_argument(
        "--journal",
        choices=("keep", "capped", "volatile"),
        default="keep",
        help="the board's journal, for an SD card's sake: capped (on disk within 64 MiB), "
        "volatile (in RAM only, lost at reboot) or keep (default: untouched); a drop-in "
        "in /etc/systemd/journald.conf.d/",
    )
    p.add_argument(
        "--noatime",
        action="store_true",
        help="mount /, /var and /var/lib with noatime (their /etc/fstab lines; from the next "
        "mount): reads never become writes on the SD card",
    )
    p.add_argument(
        "--kubernetes-node",
        action="store_true",
        help="prepare a Kubernetes node: the kernel, swap and boot settings and the model, no "
        "slmguard units (the DaemonSet runs the server)",
    )


def parse_listen(text: str | None) -> tuple[str, int]:
    """``--listen``: ``ADDRESS``, ``ADDRESS:PORT`` or ``[IPv6]:PORT`` -> (address, port)."""
    if text is None:
        return LOOPBACK, PORT
    host, port = text, str(PORT)
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else (rest or str(PORT))
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--listen {text!r}: the port must be 1..65535")
    return host, int(port)


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="FILE",
        help="the GGUF to deploy, checked against the plan (required for a plan made "
        "with --preset; default: the file a `plan --model` plan names)",
    )
    p.add_argument(
        "--mmproj",
        type=Path,
        default=None,
        metavar="FILE",
        help="the vision projector to deploy, a copy of the one the plan names (checked "
        "by size and sha256; default: the file a `plan --mmproj` plan names)",
    )
    p.add_argument(
        "--board-model",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a copy of one of a board plan's other models (`plan --model A --model B`), "
        "given once for each, in the plan's order (checked by size and sha256; default: the "
        "files the plan names)",
    )


def planned_model(
    args: argparse.Namespace, plan: Plan, root: Path | None, digests: Digests | None = None
) -> ModelSource:
    """The model to deploy: ``--model`` or the plan's file, checked against the plan.

    ``digests``: apply's stamps of the root; a file they vouch for is not read.
    """
    from slmguard.deploy.modelfile import planned_model as check

    progress = copy_progress("checking the model's sha256")
    return check(plan, args.model, root, progress=progress, digests=digests, mmproj=args.mmproj)


def board_models(
    args: argparse.Namespace, plan: Plan, root: Path | None, digests: Digests | None = None
) -> tuple[ModelSource, ...]:
    """A board plan's other models to deploy: ``--board-model`` or the plan's files, checked."""
    from slmguard.deploy.modelfile import board_models as check

    progress = copy_progress("checking a model's sha256")
    return check(plan, root, progress, digests, given=tuple(args.board_model))


def copy_progress(what: str) -> Callable[[int, int], None]:
    """A progress printer for long copies (stderr, every 10%, only above 64 MiB)."""
    shown = [-10]

    def progress(done: int, total: int) -> None:
        if total < 64 << 20:
            return
        pct = done * 100 // max(total, 1)
        if pct >= shown[0] + 10 or done == total:
            shown[0] = pct
            print(f"{what}: {pct}% of {total >> 20} MiB", file=sys.stderr, flush=True)

    return progress


def default_exec() -> str:
    """This slmguard's own executable, so the units run the installation that wrote them."""
    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name == "slmguard" and os.access(argv0, os.X_OK):
        return os.path.abspath(argv0)
    found = shutil.which("slmguard")
    return os.path.abspath(found) if found else DEFAULT_EXEC


def unit_options(args: argparse.Namespace) -> RenderOptions:
    host, port = parse_listen(args.listen)
    return RenderOptions(
        exec_path=args.exec_path or default_exec(),
        business_slice=args.business_slice,
        protect=tuple(args.protect),
        host=host,
        port=port,
        allow=tuple(args.allow),
        kubernetes_node=args.kubernetes_node,
        journal=args.journal,
        noatime=args.noatime,
    )


def plan_path(args: argparse.Namespace, root: Path) -> Path:
    """``--plan``, else the plan a previous apply installed under the root."""
    if args.plan is not None:
        return Path(args.plan)
    installed = root / PLAN_PATH.lstrip("/")
    if installed.is_file():
        return installed
    raise UsageError(
        f"no plan: give --plan FILE (no {installed} from an earlier apply)",
        hint="write one with `slmguard plan --json > plan.json`",
    )


def print_commands(commands: Sequence[Sequence[str]], failed: Sequence[str]) -> None:
    """The host commands run after writing (``sysctl --system``, ...); failures on stderr."""
    for cmd in commands:
        print(f"ran: {' '.join(cmd)}")
    for failure in failed:
        print(f"warning: {failure}", file=sys.stderr)
