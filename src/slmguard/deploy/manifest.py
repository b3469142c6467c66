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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slmguard.deploy.changes import Change
from slmguard.errors import HostReadError, RefusedError

MANIFEST_SCHEMA = "slmguard.apply/1"
APPLY_DIR = "/var/lib/slmguard-apply"
MANIFEST_NAME = "manifest.json"


def apply_dir(root: Path) -> Path:
    """Where apply keeps its manifest and backups for this root (see module docstring)."""
    return root / APPLY_DIR.lstrip("/")


def backup_rel(dest: str) -> str:
    """The backup of destination ``dest``, relative to :func:`apply_dir`."""
    return "backup/" + dest.lstrip("/")


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


def load_manifest(root: Path) -> Manifest | None:
    """The manifest of an earlier apply under ``root``, or None when there is none."""
    path = apply_dir(root) / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise HostReadError(path, err.strerror or str(err)) from err
    try:
        raw = json.loads(data)
    except json.JSONDecodeError as err:
        raise RefusedError(
            f"{path}: not valid JSON ({err.msg}); refusing to guess what apply changed",
            facts={"path": str(path)},
        ) from err
    if not isinstance(raw, dict) or raw.get("schema") != MANIFEST_SCHEMA:
        raise RefusedError(f"{path}: not an slmguard apply manifest", facts={"path": str(path)})
    before = raw.get("sysctl_before", {})
    return Manifest(
        str(raw["root"]),
        list(raw["entries"]),
        list(raw["created_dirs"]),
        {str(k): str(v) for k, v in before.items()} if isinstance(before, dict) else {},
    )
