"""The host tools apply and rollback run after writing: ``sysctl --system``, ``daemon-reload``.

Only when the root is ``/`` (a mounted image is not a running system) and only
the tools that are installed. A tool that fails is reported, never raised: the
files are already written and the manifest can undo them.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

from slmguard.deploy.storage import JOURNALD_DROPIN
from slmguard.deploy.system import SYSCTL_PATH

SYSTEM_ROOT = Path("/")


def post_commands(
    root: Path,
    changed: Iterable[str],
    which: Callable[[str], str | None] = shutil.which,
) -> list[tuple[str, ...]]:
    """The tools to run after writing: only for root ``/`` and only those installed."""
    if root.resolve() != SYSTEM_ROOT:
        return []
    changed = set(changed)
    cmds: list[tuple[str, ...]] = []
    if SYSCTL_PATH in changed and which("sysctl"):
        cmds.append(("sysctl", "--system"))
    if any(p.startswith("/etc/systemd/") for p in changed) and which("systemctl"):
        cmds.append(("systemctl", "daemon-reload"))
        if JOURNALD_DROPIN in changed:  # journald reads its drop-ins when it restarts
            cmds.append(("systemctl", "restart", "systemd-journald"))
    return cmds


def run_commands(cmds: list[tuple[str, ...]]) -> list[str]:
    """Run each command; the failures, one line each."""
    failed = []
    for cmd in cmds:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            failed.append(f"{' '.join(cmd)}: {err}")
            continue
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            failed.append(f"{' '.join(cmd)} exited {proc.returncode}: {tail[0]}")
    return failed
