"""rollback: put back, byte for byte, everything apply recorded in its manifest.

Owns the three ways back: :func:`rollback` (everything apply changed, then the
running sysctl values), :func:`rollback_previous` (``rollback --to previous``:
one plan back, optionally only a given fleet ``rollout``'s) and
:func:`rollback_unfinished` (``--if-unfinished``, run by
``slmguard-recover.service`` at boot: only an apply that did not finish). Every
backup's SHA-256 is checked before anything is restored, and the manifest is
rewritten only after every path is, so a rollback that dies can be run again.
``docs/deploy.md`` (A power cut during apply) tells the story.

It must not trust the manifest: it is validated as it is read
(:func:`slmguard.deploy.manifest.load_manifest`) and every path it names is
confined to the root (:mod:`slmguard.deploy.rootpath`) before the first file is
touched. It writes nothing outside what the manifest recorded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from slmguard import atomicio
from slmguard.deploy.digests import Digests, load_digests
from slmguard.deploy.hosttools import SYSTEM_ROOT, post_commands, run_commands
from slmguard.deploy.manifest import (
    APPLY_DIR,
    MANIFEST_DEST,
    Manifest,
    Previous,
    backup_dest,
    load_manifest,
    remove_stale_previous,
)
from slmguard.deploy.rootpath import check_root, confine
from slmguard.deploy.target import current_state, file_digest
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
    #: rollback --to previous: the plan (plan.json's sha256) now in place, None when
    #: back before the first apply; no_previous: there was no previous plan to go to.
    plan_sha256: str | None = None
    to_initial: bool = False
    no_previous: bool = False
    #: rollback --to previous --rollout ID on a deployment another rollout (or none) made:
    #: nothing was touched; ``other_rollout`` is the one that made it.
    not_this_rollout: bool = False
    other_rollout: str | None = None
    unfinished: bool = False  # rollback --if-unfinished: the last apply had not finished
    dry_run: bool = False  # nothing was written: what a rollback would do


#: A backup larger than this (the model) is checked by stamp or streamed hash and put
#: back as a hard link (or a streamed copy), never read into memory.
LARGE_BACKUP_BYTES = 1 << 20


def _check_paths(
    w: RootWriter, entries: list[dict[str, Any]], dirs: list[str], base: str = "backup"
) -> None:
    """Every path the records name stays inside the root: checked before anything is touched."""
    w.path(APPLY_DIR)
    for e in entries:
        w.path(str(e["path"]))
        if e.get("kind") == "file":
            w.path(backup_dest(str(e["path"]), base))
    for d in dirs:
        w.path(d)


def _damaged(e: dict[str, Any], path: Path) -> RefusedError:
    return RefusedError(
        f"backup of {e['path']} is missing or damaged; nothing was restored",
        facts={"path": e["path"], "backup": str(path)},
    )


def _verified_backups(
    w: RootWriter,
    entries: list[dict[str, Any]],
    base: str = "backup",
    digests: Digests | None = None,
) -> dict[str, bytes | Path]:
    """Every backup by destination: its bytes, or its path when large (checked by stamp or a
    streamed hash). RefusedError when one is missing or damaged."""
    backups: dict[str, bytes | Path] = {}
    for e in entries:
        if not (e.get("existed") and e.get("kind") == "file"):
            continue
        path = confine(w.root, backup_dest(str(e["path"]), base), follow=True, where="backup")
        kept: bytes | Path = path
        try:
            if path.stat().st_size > LARGE_BACKUP_BYTES:
                ok = file_digest(path, digests) == e["sha256"]
            else:
                kept = path.read_bytes()
                ok = hashlib.sha256(kept).hexdigest() == e["sha256"]
        except FileNotFoundError:
            raise _damaged(e, path) from None
        except OSError as err:
            raise HostReadError(path, err.strerror or str(err)) from err
        if not ok:
            raise _damaged(e, path)
        backups[str(e["path"])] = kept
    return backups


def _outcome(w: RootWriter, e: dict[str, Any]) -> str | None:
    """What putting ``e`` back does: 'restored', 'removed' or None (nothing there to remove)."""
    if e.get("existed"):
        return "restored"
    now = current_state(w.path(str(e["path"])), read_limit=0)
    return "removed" if now.kind in ("file", "link") else None


def _restore_entry(
    w: RootWriter, e: dict[str, Any], backups: dict[str, bytes | Path]
) -> str | None:
    """Put one recorded path back; 'restored', 'removed' or None (nothing to do)."""
    dest = str(e["path"])
    outcome = _outcome(w, e)
    if outcome != "restored":
        if outcome == "removed":
            w.remove(dest)
        return outcome
    w.make_dirs(dest.rsplit("/", 1)[0] or "/")
    if e["kind"] == "link":
        w.link(dest, str(e["target"]))
        return "restored"
    owner = (int(e["uid"]), int(e["gid"]))
    kept = backups[dest]
    if isinstance(kept, bytes):
        w.write(dest, kept, int(e["mode"]), owner, int(e["mtime_ns"]))
    elif not w.hardlink(dest, kept):  # the same inode: mode, owner and mtime come with it
        w.copy(dest, kept, sha256=str(e["sha256"]), mode=int(e["mode"]))
        w.set_attributes(dest, owner, int(e["mtime_ns"]))
    return "restored"


def _restore_all(
    w: RootWriter,
    entries: list[dict[str, Any]],
    backups: dict[str, bytes | Path],
    *,
    dry_run: bool = False,
) -> tuple[list[str], list[str]]:
    """Restore every record (``dry_run``: only say what would be): (restored, removed)."""
    restored, removed = [], []
    for e in entries:
        done = _outcome(w, e) if dry_run else _restore_entry(w, e, backups)
        if done == "restored":
            restored.append(str(e["path"]))
        elif done == "removed":
            removed.append(str(e["path"]))
    return restored, removed


def _remove_created_dirs(w: RootWriter, created: list[str]) -> list[str]:
    removed = []
    for dest in sorted(created, key=lambda d: d.count("/"), reverse=True):
        if w.remove_dir(dest):
            removed.append(dest)
        elif w.path(dest).exists():
            log.info("left %s in place: not empty", dest)
    return removed


def _dirs_left_empty(w: RootWriter, created: list[str], gone: set[str]) -> list[str]:
    """The created directories a rollback would remove: those left empty once ``gone``
    (the paths it removes) are, deepest first, as :func:`_remove_created_dirs` goes."""
    gone = set(gone)
    out = []
    for dest in sorted(created, key=lambda d: d.count("/"), reverse=True):
        path = w.path(dest)
        if not path.is_dir() or path.is_symlink():
            continue
        if all(f"{dest.rstrip('/')}/{name}" in gone for name in os.listdir(path)):
            out.append(dest)
            gone.add(dest)
    return out


def _sysctl_file(root: Path, key: str) -> Path | None:
    """``key``'s file under ``root/proc/sys`` when it is one, inside the root; else None."""
    try:
        path = confine(root, "/" + sysctl_path(key), follow=True, where=key)
    except RefusedError:
        return None
    return path if path.is_file() else None


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


def rollback(
    root: Path = SYSTEM_ROOT, *, run_tools: bool = True, dry_run: bool = False
) -> RollbackResult:
    """Restore every path apply recorded, byte for byte, and remove what it created.

    ``dry_run``: check the manifest and every backup as a rollback does, and return
    what it would restore, remove and run; nothing is written and nothing run.
    """
    check_root(root)
    manifest = load_manifest(root)
    if manifest is None:
        return RollbackResult((), (), (), nothing=True, dry_run=dry_run)
    w = RootWriter(root)
    _check_paths(w, manifest.entries, manifest.created_dirs)
    backups = _verified_backups(w, manifest.entries)
    restored, removed = _restore_all(w, manifest.entries, backups, dry_run=dry_run)
    if dry_run:
        gone = {*removed, APPLY_DIR}
        return RollbackResult(
            tuple(restored),
            tuple(removed),
            tuple(_dirs_left_empty(w, manifest.created_dirs, gone)),
            tuple(post_commands(root, restored + removed)) if run_tools else (),
            sysctls_restored=tuple(k for k in manifest.sysctl_before if _sysctl_file(root, k)),
            dry_run=True,
        )
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


def rollback_previous(
    root: Path = SYSTEM_ROOT,
    *,
    run_tools: bool = True,
    rollout: str | None = None,
    dry_run: bool = False,
) -> RollbackResult:
    """Go back one plan: the previous deployment, byte for byte (see the module docstring).

    ``rollout``: only when that rollout made the current deployment. ``dry_run``: as
    :func:`rollback`'s, nothing written, the manifest unchanged.
    """
    check_root(root)
    manifest = load_manifest(root)
    if manifest is None:
        return RollbackResult((), (), (), nothing=True, dry_run=dry_run)
    if rollout is not None and manifest.rollout != rollout:
        return RollbackResult(
            (),
            (),
            (),
            nothing=True,
            not_this_rollout=True,
            other_rollout=manifest.rollout,
            dry_run=dry_run,
        )
    prev = manifest.previous
    if prev is None:
        return RollbackResult((), (), (), nothing=True, no_previous=True, dry_run=dry_run)
    if prev.initial:
        return replace(rollback(root, run_tools=run_tools, dry_run=dry_run), to_initial=True)
    w = RootWriter(root)
    _check_paths(w, prev.entries, prev.created_dirs, prev.base)
    backups = _verified_backups(w, prev.entries, prev.base, load_digests(root))
    restored, removed = _restore_all(w, prev.entries, backups, dry_run=dry_run)
    if dry_run:
        return RollbackResult(
            tuple(restored),
            tuple(removed),
            tuple(_dirs_left_empty(w, prev.created_dirs, set(removed))),
            tuple(post_commands(root, restored + removed)) if run_tools else (),
            plan_sha256=prev.plan_sha256,
            dry_run=True,
        )
    removed_dirs = _remove_created_dirs(w, prev.created_dirs)
    _forget_previous(w, manifest, prev)
    cmds = post_commands(root, restored + removed) if run_tools else []
    return RollbackResult(
        tuple(restored),
        tuple(removed),
        tuple(removed_dirs),
        tuple(cmds),
        tuple(run_commands(cmds)),
        plan_sha256=prev.plan_sha256,
    )


def rollback_unfinished(root: Path = SYSTEM_ROOT, *, run_tools: bool = True) -> RollbackResult:
    """Back to the last deployment that finished, only when the last apply did not finish
    (see the module docstring); ``nothing`` when there is no manifest or it finished.

    The temporary a cut write left beside a recorded path (``.NAME.slmguard-tmp-PID``,
    :func:`slmguard.atomicio.tmp_name`: created, not yet renamed over NAME) is removed too.
    """
    check_root(root)
    manifest = load_manifest(root)
    if manifest is None or manifest.complete:
        return RollbackResult((), (), (), nothing=True)
    log.warning("the last apply under %s did not finish: going back to the last one that did",
                root)  # fmt: skip
    recorded = manifest.paths() | (manifest.previous.paths() if manifest.previous else set())
    w = RootWriter(root)
    _check_paths(w, [{"path": p} for p in recorded], [])
    result = rollback_previous(root, run_tools=run_tools)
    temporaries = _remove_temporaries(w, recorded)
    return replace(result, unfinished=True, removed=result.removed + temporaries)


def _remove_temporaries(w: RootWriter, recorded: set[str]) -> tuple[str, ...]:
    """Remove the temporaries of atomic writes a cut left beside the recorded paths (files
    and links named as :func:`slmguard.atomicio.tmp_name` names them, nothing else)."""
    removed = []
    for dest in sorted(recorded):
        parent, _, name = dest.rpartition("/")
        found = w.path(parent or "/")
        pattern = re.compile(re.escape(f".{name}{atomicio.TMP_INFIX}") + r"[0-9]+")
        try:
            names = [n for n in os.listdir(found) if pattern.fullmatch(n)]
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as err:
            raise HostReadError(found, err.strerror or str(err)) from err
        for n in names:
            tmp = f"{parent}/{n}"
            if current_state(w.path(tmp), read_limit=0).kind in ("file", "link"):
                w.remove(tmp)
                log.info("removed %s (a write the cut apply had begun)", tmp)
                removed.append(tmp)
    return tuple(removed)


def _forget_previous(w: RootWriter, manifest: Manifest, prev: Previous) -> None:
    """The previous deployment is the current one now; its snapshot goes (after the record)."""
    manifest.plan_sha256 = prev.plan_sha256
    manifest.rollout = prev.rollout
    manifest.complete = True
    manifest.previous = None
    manifest.created_dirs = [d for d in manifest.created_dirs if w.path(d).exists()]
    w.write(MANIFEST_DEST, manifest.to_json().encode(), 0o600)
    remove_stale_previous(w, manifest)
