"""rollback: put back, byte for byte, everything apply recorded in its manifest.

Every backup's SHA-256 is checked first (a damaged backup refuses the whole
rollback, nothing restored). Then each recorded path is restored (bytes, mode,
owner, mtime, or symlink target) or, when it did not exist, removed; the
directories apply created are removed when empty; the manifest and its
backups go last. After ``sysctl --system`` (on ``/``), the running sysctl
values recorded by the first apply are written back under ``<root>/proc/sys``:
the running kernel returns to where apply found it, not only /etc.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slmguard.deploy import writer
from slmguard.deploy.hosttools import SYSTEM_ROOT, post_commands, run_commands
from slmguard.deploy.manifest import Manifest, apply_dir, load_manifest
from slmguard.deploy.target import current_state, under
from slmguard.errors import HostReadError, RefusedError
from slmguard.host.procfs import sysctl_path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RollbackResult:
    restored: tuple[str, ...]
    removed: tuple[str, ...]
    removed_dirs: tuple[str, ...]
    commands: tuple[tuple[str, ...], ...] = ()
    failed_commands: tuple[str, ...] = ()
    nothing: bool = False
    sysctls_restored: tuple[str, ...] = ()  # running values written back under /proc/sys


def _verified_backups(root: Path, manifest: Manifest) -> dict[str, bytes]:
    """Every backup's bytes by destination; RefusedError when one is missing or damaged."""
    adir = apply_dir(root)
    backups: dict[str, bytes] = {}
    for e in manifest.entries:
        if not (e.get("existed") and e.get("kind") == "file"):
            continue
        path = adir / str(e["backup"])
        try:
            data: bytes | None = path.read_bytes()
        except FileNotFoundError:
            data = None
        except OSError as err:
            raise HostReadError(path, err.strerror or str(err)) from err
        if data is None or hashlib.sha256(data).hexdigest() != e["sha256"]:
            raise RefusedError(
                f"backup of {e['path']} is missing or damaged; nothing was restored",
                facts={"path": e["path"], "backup": str(path)},
            )
        backups[str(e["path"])] = data
    return backups


def _restore_entry(root: Path, e: dict[str, Any], backups: dict[str, bytes]) -> str | None:
    """Put one recorded path back; 'restored', 'removed' or None (nothing to do)."""
    dest = str(e["path"])
    path = under(root, dest)
    if not e.get("existed"):
        if current_state(path).kind in ("file", "link"):
            writer.remove(path)
            return "removed"
        return None
    writer.make_dirs(writer.missing_dirs(path.parent, root))
    if e["kind"] == "link":
        writer.write_link(path, str(e["target"]))
    else:
        owner = (int(e["uid"]), int(e["gid"]))
        writer.write_file(path, backups[dest], int(e["mode"]), owner, int(e["mtime_ns"]))
    return "restored"


def _remove_created_dirs(root: Path, created: list[str]) -> list[str]:
    removed = []
    for dest in sorted(created, key=lambda d: d.count("/"), reverse=True):
        d = under(root, dest)
        try:
            d.rmdir()
            removed.append(dest)
        except FileNotFoundError:
            continue
        except OSError:  # not empty: something else was put there since
            log.info("left %s in place: not empty", d)
    return removed


def _restore_sysctls(root: Path, values: dict[str, str]) -> tuple[list[str], list[str]]:
    """Write recorded values back to ``root/proc/sys``; (restored keys, failures)."""
    restored, failed = [], []
    for key, value in values.items():
        path = root / sysctl_path(key)
        if not path.is_file():
            continue
        try:
            with path.open("w") as f:
                f.write(value + "\n")
        except OSError as err:
            failed.append(f"{key}={value}: {err.strerror or err}")
            continue
        restored.append(key)
    return restored, failed


def rollback(root: Path = SYSTEM_ROOT, *, run_tools: bool = True) -> RollbackResult:
    """Restore every path apply recorded, byte for byte, and remove what it created."""
    manifest = load_manifest(root)
    if manifest is None:
        return RollbackResult((), (), (), nothing=True)
    backups = _verified_backups(root, manifest)
    restored, removed = [], []
    for e in manifest.entries:
        done = _restore_entry(root, e, backups)
        if done == "restored":
            restored.append(str(e["path"]))
        elif done == "removed":
            removed.append(str(e["path"]))
    adir = apply_dir(root)
    with writer.writing(adir):
        shutil.rmtree(adir)
    removed_dirs = _remove_created_dirs(root, manifest.created_dirs)
    cmds = post_commands(root, restored + removed) if run_tools else []
    failed = run_commands(cmds)
    # After `sysctl --system`: it re-reads the remaining files, and only the
    # recorded values put the running kernel back where apply found it.
    sysctls, sysctl_failed = _restore_sysctls(root, manifest.sysctl_before)
    return RollbackResult(
        tuple(restored),
        tuple(removed),
        tuple(removed_dirs),
        tuple(cmds),
        tuple(failed + sysctl_failed),
        sysctls_restored=tuple(sysctls),
    )
