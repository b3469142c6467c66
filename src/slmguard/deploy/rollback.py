"""rollback: put back, byte for byte, everything apply recorded in its manifest.

Every backup's SHA-256 is checked first (a damaged backup refuses the whole
rollback, nothing restored). Then each recorded path is restored (bytes, mode,
owner, mtime, or symlink target) or, when it did not exist, removed; the
directories apply created are removed when empty; the manifest and its
backups go last. After ``sysctl --system`` (on ``/``), the running sysctl
values recorded by the first apply are written back under ``<root>/proc/sys``:
the running kernel returns to where apply found it, not only /etc.

The manifest is a file on the target and is not trusted: it is validated as it
is read (:func:`slmguard.deploy.manifest.load_manifest`), and every path it
names (entries, backups, created directories) is confined to the root
(:mod:`slmguard.deploy.rootpath`) before the first file is touched.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slmguard.deploy.hosttools import SYSTEM_ROOT, post_commands, run_commands
from slmguard.deploy.manifest import APPLY_DIR, Manifest, backup_dest, load_manifest
from slmguard.deploy.rootpath import check_root, confine
from slmguard.deploy.target import current_state
from slmguard.deploy.writer import RootWriter, writing
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


def _check_paths(w: RootWriter, manifest: Manifest) -> None:
    """Every path the manifest names stays inside the root: checked before anything is touched."""
    w.path(APPLY_DIR)
    for e in manifest.entries:
        w.path(str(e["path"]))
        if e.get("kind") == "file":
            w.path(backup_dest(str(e["path"])))
    for d in manifest.created_dirs:
        w.path(d)


def _verified_backups(w: RootWriter, manifest: Manifest) -> dict[str, bytes]:
    """Every backup's bytes by destination; RefusedError when one is missing or damaged."""
    backups: dict[str, bytes] = {}
    for e in manifest.entries:
        if not (e.get("existed") and e.get("kind") == "file"):
            continue
        path = confine(w.root, backup_dest(str(e["path"])), follow=True, where="backup")
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


def _restore_entry(w: RootWriter, e: dict[str, Any], backups: dict[str, bytes]) -> str | None:
    """Put one recorded path back; 'restored', 'removed' or None (nothing to do)."""
    dest = str(e["path"])
    if not e.get("existed"):
        if current_state(w.path(dest)).kind in ("file", "link"):
            w.remove(dest)
            return "removed"
        return None
    w.make_dirs(dest.rsplit("/", 1)[0] or "/")
    if e["kind"] == "link":
        w.link(dest, str(e["target"]))
    else:
        owner = (int(e["uid"]), int(e["gid"]))
        w.write(dest, backups[dest], int(e["mode"]), owner, int(e["mtime_ns"]))
    return "restored"


def _remove_created_dirs(w: RootWriter, created: list[str]) -> list[str]:
    removed = []
    for dest in sorted(created, key=lambda d: d.count("/"), reverse=True):
        if w.remove_dir(dest):
            removed.append(dest)
        elif w.path(dest).exists():
            log.info("left %s in place: not empty", dest)
    return removed


def _restore_sysctls(root: Path, values: dict[str, str]) -> tuple[list[str], list[str]]:
    """Write recorded values back to ``root/proc/sys``; (restored keys, failures).

    A /proc/sys file that leads out of the root (a symlink) is not written: reported.
    """
    restored, failed = [], []
    for key, value in values.items():
        try:
            path = confine(root, "/" + sysctl_path(key), follow=True, where=key)
        except RefusedError as err:
            failed.append(f"{key}={value}: {err.message}")
            continue
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
    check_root(root)
    manifest = load_manifest(root)
    if manifest is None:
        return RollbackResult((), (), (), nothing=True)
    w = RootWriter(root)
    _check_paths(w, manifest)
    backups = _verified_backups(w, manifest)
    restored, removed = [], []
    for e in manifest.entries:
        done = _restore_entry(w, e, backups)
        if done == "restored":
            restored.append(str(e["path"]))
        elif done == "removed":
            removed.append(str(e["path"]))
    adir = w.path(APPLY_DIR)
    with writing(adir):
        shutil.rmtree(adir)
    removed_dirs = _remove_created_dirs(w, manifest.created_dirs)
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
