"""apply's record of what it changed: the manifest and where its backups live.

Owns ``<root>/var/lib/slmguard-apply/manifest.json`` (schema
``slmguard.apply/1``) and the layout of ``backup/`` beside it. One entry per
destination apply ever touched, with the state it found there before the first
apply: the bytes' SHA-256, mode, owner and mtime (the bytes themselves in
``backup/<path>``), or the symlink's target, or "did not exist". Also the
directories apply created and the running sysctl values before the first
apply wrote the sysctl file.

Not inside the services' state directory ``/var/lib/slmguard``: systemd chowns
a ``StateDirectory=`` recursively to the service user at every start, and a
service user able to rewrite the backups (and their checksums) could make
root's next rollback write anything into /etc or /boot.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slmguard.deploy.changes import Change
from slmguard.deploy.rootpath import confine, dest_path
from slmguard.deploy.system import SYSCTL_RANGES
from slmguard.errors import HostReadError, RefusedError

MANIFEST_SCHEMA = "slmguard.apply/1"
APPLY_DIR = "/var/lib/slmguard-apply"
BACKUP_DIR = f"{APPLY_DIR}/backup"
MANIFEST_NAME = "manifest.json"
MANIFEST_DEST = f"{APPLY_DIR}/{MANIFEST_NAME}"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SYSCTL_VALUE = re.compile(r"-?[0-9]{1,19}")


def apply_dir(root: Path) -> Path:
    """Where apply keeps its manifest and backups for this root (see module docstring)."""
    return root / APPLY_DIR.lstrip("/")


def backup_rel(dest: str) -> str:
    """The backup of destination ``dest``, relative to :func:`apply_dir`."""
    return "backup/" + dest.lstrip("/")


def backup_dest(dest: str) -> str:
    """The backup of destination ``dest`` as a destination itself."""
    return f"{BACKUP_DIR}{dest}"


@dataclass
class Manifest:
    root: str
    entries: list[dict[str, Any]] = field(default_factory=list)
    created_dirs: list[str] = field(default_factory=list)
    sysctl_before: dict[str, str] = field(default_factory=dict)  # running values, by key

    def paths(self) -> set[str]:
        return {str(e["path"]) for e in self.entries}

    def to_json(self) -> str:
        data = {
            "schema": MANIFEST_SCHEMA,
            "root": self.root,
            "entries": self.entries,
            "created_dirs": self.created_dirs,
            "sysctl_before": self.sysctl_before,
        }
        return json.dumps(data, indent=2) + "\n"


def entry_for(change: Change) -> dict[str, Any]:
    """The manifest entry recording what ``change`` is about to replace."""
    now = change.current
    if change.old_link is not None:
        return {"path": change.path, "existed": True, "kind": "link", "target": change.old_link}
    if change.old_bytes is None:
        return {"path": change.path, "existed": False}
    return {
        "path": change.path,
        "existed": True,
        "kind": "file",
        "backup": backup_rel(change.path),
        "sha256": hashlib.sha256(change.old_bytes).hexdigest(),
        "mode": now.mode,
        "uid": now.uid,
        "gid": now.gid,
        "mtime_ns": now.mtime_ns,
    }


def _bad(path: Path, why: str) -> RefusedError:
    return RefusedError(
        f"{path}: {why}; refusing to guess what apply changed", facts={"path": str(path)}
    )


def _int(e: dict[str, Any], key: str, lo: int, hi: int) -> bool:
    v = e.get(key)
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _check_entry(path: Path, i: int, e: object) -> dict[str, Any]:
    """One entry, every field checked: the manifest is a file on the target, as hostile as any."""
    if not isinstance(e, dict) or not isinstance(e.get("existed"), bool):
        raise _bad(path, f"entry {i} is not an apply record")
    dest = dest_path(e.get("path"), f"manifest entry {i} path")
    if not e["existed"]:
        return {"path": dest, "existed": False}
    if e.get("kind") == "link" and isinstance(e.get("target"), str):
        if not e["target"] or not e["target"].isprintable():
            raise _bad(path, f"entry {i} ({dest}): the link target is not printable text")
        return {"path": dest, "existed": True, "kind": "link", "target": e["target"]}
    ok = (
        e.get("kind") == "file"
        and e.get("backup") == backup_rel(dest)
        and isinstance(e.get("sha256"), str)
        and _SHA256.fullmatch(e["sha256"]) is not None
        and _int(e, "mode", 0, 0o7777)
        and _int(e, "uid", 0, (1 << 32) - 1)
        and _int(e, "gid", 0, (1 << 32) - 1)
        and _int(e, "mtime_ns", -(1 << 63), (1 << 63) - 1)
    )
    if not ok:
        raise _bad(path, f"entry {i} ({dest}) is not a valid file record")
    keys = ("path", "existed", "kind", "backup", "sha256", "mode", "uid", "gid", "mtime_ns")
    return {k: e[k] for k in keys}


def _check_sysctls(path: Path, before: object) -> dict[str, str]:
    """Recorded running values: only the keys apply sets, only integers."""
    if not isinstance(before, dict):
        raise _bad(path, "sysctl_before is not an object")
    for key, value in before.items():
        if key not in SYSCTL_RANGES or not isinstance(value, str):
            raise _bad(path, f"sysctl_before holds {str(key)[:40]!r}, not a key apply sets")
        if not _SYSCTL_VALUE.fullmatch(value):
            raise _bad(path, f"sysctl_before[{key!r}] is not an integer")
    return dict(before)


def load_manifest(root: Path) -> Manifest | None:
    """The manifest of an earlier apply under ``root``, or None when there is none.

    Every field is checked before it is used: each path a plain destination
    (rollback confines them to the root before touching any), each backup
    named for its path, modes, owners and checksums of the right shape, only
    the sysctl keys apply sets. Anything else: RefusedError, nothing touched.
    """
    path = confine(root, MANIFEST_DEST, follow=True, where="the apply manifest")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise HostReadError(path, err.strerror or str(err)) from err
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RefusedError(
            f"{path}: not valid JSON ({err}); refusing to guess what apply changed",
            facts={"path": str(path)},
        ) from err
    if not isinstance(raw, dict) or raw.get("schema") != MANIFEST_SCHEMA:
        raise RefusedError(f"{path}: not an slmguard apply manifest", facts={"path": str(path)})
    entries, dirs = raw.get("entries"), raw.get("created_dirs")
    if not isinstance(entries, list) or not isinstance(dirs, list):
        raise _bad(path, "entries and created_dirs must be lists")
    return Manifest(
        str(raw.get("root", "")),
        [_check_entry(path, i, e) for i, e in enumerate(entries)],
        [dest_path(d, f"manifest created_dirs[{i}]") for i, d in enumerate(dirs)],
        _check_sysctls(path, raw.get("sysctl_before", {})),
    )
