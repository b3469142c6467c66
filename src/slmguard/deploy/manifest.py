"""apply's record of what it changed: the manifest, the previous deployment, where backups live.

Owns ``<root>/var/lib/slmguard-apply/manifest.json`` (schema ``slmguard.apply/2``;
``/1`` is read too) and the layout beside it: ``entries`` (each destination's state
before the first apply, its bytes in ``backup/<path>``; the directories apply created,
the sysctl values it found: what ``rollback`` returns to), ``deployment`` (the plan in
place now, its generation, its rollout, whether its apply finished: ``complete``) and
``previous`` (the state one plan back, in ``previous-<gen>/<path>``, or ``initial``).
It is written atomically before the first target is touched and again at the end, and
names a backup only once it is on disk, so it is consistent whenever apply dies.

It must not live in the services' ``StateDirectory=`` (systemd chowns that to the
service user, who could then rewrite root's backups; ``docs/deploy.md`` says why), nor
restore anything itself (:mod:`slmguard.deploy.rollback`). A manifest read back is
untrusted and validated here, in :func:`load_manifest`.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slmguard.deploy.rootpath import confine, dest_path
from slmguard.deploy.system import SYSCTL_RANGES
from slmguard.deploy.target import Current
from slmguard.deploy.writer import RootWriter, writing
from slmguard.errors import HostReadError, RefusedError

MANIFEST_SCHEMA = "slmguard.apply/2"
#: Schemas load_manifest reads (an /1 manifest has no deployment and no previous).
READ_SCHEMAS = ("slmguard.apply/1", MANIFEST_SCHEMA)
APPLY_DIR = "/var/lib/slmguard-apply"
BACKUP_DIR = f"{APPLY_DIR}/backup"
MANIFEST_NAME = "manifest.json"
MANIFEST_DEST = f"{APPLY_DIR}/{MANIFEST_NAME}"
#: The previous deployment's files live in ``previous-<gen>/`` beside the manifest.
PREVIOUS_PREFIX = "previous-"
#: A manifest larger than this is not read (a few hundred entries take ~100 KiB).
MANIFEST_MAX_BYTES = 16 << 20
#: More entries than this in one list is not a manifest apply wrote.
MAX_ENTRIES = 10_000
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SYSCTL_VALUE = re.compile(r"-?[0-9]{1,19}")
#: A rollout's id (``apply --rollout``): a label, safe in a file name, a YAML scalar, a log.
ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,63}")
_MAX_GEN = (1 << 53) - 1


def apply_dir(root: Path) -> Path:
    """Where apply keeps its manifest and backups for this root (see module docstring)."""
    return root / APPLY_DIR.lstrip("/")


def backup_rel(dest: str, base: str = "backup") -> str:
    """The backup of destination ``dest``, relative to :func:`apply_dir`."""
    return f"{base}/" + dest.lstrip("/")


def backup_dest(dest: str, base: str = "backup") -> str:
    """The backup of destination ``dest`` as a destination itself."""
    return f"{APPLY_DIR}/{backup_rel(dest, base)}"


def previous_base(gen: int) -> str:
    """The directory (relative to :func:`apply_dir`) of generation ``gen``'s previous files."""
    return f"{PREVIOUS_PREFIX}{gen}"


@dataclass
class Previous:
    """The deployment before the current one: how to return to it, path by path.

    ``initial``: the current deployment is the first, so the previous state is
    the one before any apply (the manifest's ``entries``). Otherwise
    ``entries`` hold the state of every path the current deployment changed,
    with their bytes under :func:`previous_base` (``gen``), and
    ``created_dirs`` the directories the current deployment's apply created.
    """

    gen: int
    plan_sha256: str | None = None
    initial: bool = False
    entries: list[dict[str, Any]] = field(default_factory=list)
    created_dirs: list[str] = field(default_factory=list)
    rollout: str | None = None  # the rollout that made the previous deployment

    @property
    def base(self) -> str:
        return previous_base(self.gen)

    def paths(self) -> set[str]:
        return {str(e["path"]) for e in self.entries}

    def to_dict(self) -> dict[str, Any]:
        return {
            "gen": self.gen,
            "plan_sha256": self.plan_sha256,
            "initial": self.initial,
            "entries": self.entries,
            "created_dirs": self.created_dirs,
            "rollout": self.rollout,
        }


@dataclass
class Manifest:
    root: str
    entries: list[dict[str, Any]] = field(default_factory=list)
    created_dirs: list[str] = field(default_factory=list)
    sysctl_before: dict[str, str] = field(default_factory=dict)  # running values, by key
    plan_sha256: str | None = None  # the deployed plan.json's sha256 (None: an /1 manifest)
    gen: int = 0  # the current deployment's generation: 1 for the first apply
    complete: bool = True  # False while (or when) an apply is writing
    previous: Previous | None = None
    rollout: str | None = None  # the rollout that made the current deployment (apply --rollout)

    def paths(self) -> set[str]:
        return {str(e["path"]) for e in self.entries}

    def to_json(self) -> str:
        data = {
            "schema": MANIFEST_SCHEMA,
            "root": self.root,
            "entries": self.entries,
            "created_dirs": self.created_dirs,
            "sysctl_before": self.sysctl_before,
            "deployment": {
                "plan_sha256": self.plan_sha256,
                "gen": self.gen,
                "complete": self.complete,
                "rollout": self.rollout,
            },
            "previous": None if self.previous is None else self.previous.to_dict(),
        }
        return json.dumps(data, indent=2) + "\n"


def state_entry(dest: str, now: Current, base: str, sha256: str | None = None) -> dict[str, Any]:
    """The record of ``dest`` in state ``now``, its bytes (if a file) kept under ``base``.

    ``sha256``: the file's digest when its bytes were not read (a large file);
    otherwise it is computed from ``now.data``.
    """
    if now.kind == "link":
        return {"path": dest, "existed": True, "kind": "link", "target": now.link}
    if now.kind != "file":
        return {"path": dest, "existed": False}
    digest = sha256 if now.data is None else hashlib.sha256(now.data).hexdigest()
    if digest is None:
        raise ValueError(f"{dest}: a file's record needs its bytes or its sha256")
    return {
        "path": dest,
        "existed": True,
        "kind": "file",
        "backup": backup_rel(dest, base),
        "sha256": digest,
        "size": now.size_bytes,
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


_FILE_KEYS = ("path", "existed", "kind", "backup", "sha256", "mode", "uid", "gid", "mtime_ns")


def _check_entry(path: Path, where: str, e: object, base: str) -> dict[str, Any]:
    """One entry, every field checked: the manifest is a file on the target, as hostile as any."""
    if not isinstance(e, dict) or not isinstance(e.get("existed"), bool):
        raise _bad(path, f"{where} is not an apply record")
    dest = dest_path(e.get("path"), f"manifest {where} path")
    if not e["existed"]:
        return {"path": dest, "existed": False}
    if e.get("kind") == "link" and isinstance(e.get("target"), str):
        if not e["target"] or not e["target"].isprintable():
            raise _bad(path, f"{where} ({dest}): the link target is not printable text")
        return {"path": dest, "existed": True, "kind": "link", "target": e["target"]}
    ok = (
        e.get("kind") == "file"
        and e.get("backup") == backup_rel(dest, base)
        and isinstance(e.get("sha256"), str)
        and _SHA256.fullmatch(e["sha256"]) is not None
        and _int(e, "mode", 0, 0o7777)
        and _int(e, "uid", 0, (1 << 32) - 1)
        and _int(e, "gid", 0, (1 << 32) - 1)
        and _int(e, "mtime_ns", -(1 << 63), (1 << 63) - 1)
        and (e.get("size") is None or _int(e, "size", 0, (1 << 63) - 1))
    )
    if not ok:
        raise _bad(path, f"{where} ({dest}) is not a valid file record")
    checked = {k: e[k] for k in _FILE_KEYS}
    if e.get("size") is not None:
        checked["size"] = e["size"]
    return checked


def _check_list(path: Path, where: str, value: object) -> list[Any]:
    if not isinstance(value, list) or len(value) > MAX_ENTRIES:
        raise _bad(path, f"{where} must be a list of at most {MAX_ENTRIES}")
    return value


def _check_entries(path: Path, where: str, value: object, base: str) -> list[dict[str, Any]]:
    items = _check_list(path, where, value)
    return [_check_entry(path, f"{where}[{i}]", e, base) for i, e in enumerate(items)]


def _check_dirs(path: Path, where: str, value: object) -> list[str]:
    items = _check_list(path, where, value)
    return [dest_path(d, f"manifest {where}[{i}]") for i, d in enumerate(items)]


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


def _check_sha(path: Path, where: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise _bad(path, f"{where} is not a sha256")
    return value


def check_rollout(value: object) -> str | None:
    """A rollout id as apply records it (:data:`ROLLOUT_ID`), or None; ValueError otherwise."""
    if value is None:
        return None
    if not isinstance(value, str) or not ROLLOUT_ID.fullmatch(value):
        raise ValueError(f"{str(value)[:70]!r} is not a rollout id ({ROLLOUT_ID.pattern})")
    return value


def _rollout(path: Path, where: str, value: object) -> str | None:
    try:
        return check_rollout(value)
    except ValueError as err:
        raise _bad(path, f"{where}: {err}") from None


def _check_previous(path: Path, raw: object) -> Previous | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not _int(raw, "gen", 1, _MAX_GEN):
        raise _bad(path, "previous is not a deployment record")
    initial = raw.get("initial")
    if not isinstance(initial, bool):
        raise _bad(path, "previous.initial is not true or false")
    gen = int(raw["gen"])
    return Previous(
        gen,
        _check_sha(path, "previous.plan_sha256", raw.get("plan_sha256")),
        initial,
        _check_entries(path, "previous.entries", raw.get("entries", []), previous_base(gen)),
        _check_dirs(path, "previous.created_dirs", raw.get("created_dirs", [])),
        _rollout(path, "previous.rollout", raw.get("rollout")),
    )


def _read(path: Path) -> dict[str, Any] | None:
    """The manifest's JSON object; None when there is no manifest."""
    try:
        with path.open("rb") as f:
            data = f.read(MANIFEST_MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise HostReadError(path, err.strerror or str(err)) from err
    if len(data) > MANIFEST_MAX_BYTES:
        raise _bad(path, f"larger than {MANIFEST_MAX_BYTES >> 20} MiB")
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise RefusedError(
            f"{path}: not valid JSON ({err}); refusing to guess what apply changed",
            facts={"path": str(path)},
        ) from err
    if not isinstance(raw, dict) or raw.get("schema") not in READ_SCHEMAS:
        raise RefusedError(f"{path}: not an slmguard apply manifest", facts={"path": str(path)})
    return raw


def load_manifest(root: Path) -> Manifest | None:
    """The manifest of an earlier apply under ``root``, or None when there is none.

    Every field is checked before it is used: each path a plain destination
    (rollback confines them to the root before touching any), each backup
    named for its path, modes, owners and checksums of the right shape, only
    the sysctl keys apply sets. Anything else: RefusedError, nothing touched.
    """
    path = confine(root, MANIFEST_DEST, follow=True, where="the apply manifest")
    raw = _read(path)
    if raw is None:
        return None
    deployment = raw.get("deployment", {"gen": 0, "complete": True})
    if (
        not isinstance(deployment, dict)
        or not _int(deployment, "gen", 0, _MAX_GEN)
        or not isinstance(deployment.get("complete"), bool)
    ):
        raise _bad(path, "deployment is not a deployment record")
    return Manifest(
        str(raw.get("root", "")),
        _check_entries(path, "entries", raw.get("entries"), "backup"),
        _check_dirs(path, "created_dirs", raw.get("created_dirs")),
        _check_sysctls(path, raw.get("sysctl_before", {})),
        _check_sha(path, "deployment.plan_sha256", deployment.get("plan_sha256")),
        int(deployment["gen"]),
        bool(deployment["complete"]),
        _check_previous(path, raw.get("previous")),
        _rollout(path, "deployment.rollout", deployment.get("rollout")),
    )


_PREVIOUS_DIR = re.compile(re.escape(PREVIOUS_PREFIX) + r"[0-9]+")


def remove_tree(w: RootWriter, dest: str) -> None:
    """Remove the directory ``dest`` of apply's own (kept files) with all it holds, if there."""
    path = w.path(dest)
    if path.is_dir() and not path.is_symlink():
        with writing(path):
            shutil.rmtree(path)


def remove_stale_previous(w: RootWriter, manifest: Manifest) -> None:
    """Remove the ``previous-<gen>`` directories the manifest no longer names."""
    keep = None if manifest.previous is None else manifest.previous.base
    adir = w.path(APPLY_DIR)
    if not adir.is_dir():
        return
    for child in adir.iterdir():
        if _PREVIOUS_DIR.fullmatch(child.name) and child.name != keep:
            remove_tree(w, f"{APPLY_DIR}/{child.name}")
