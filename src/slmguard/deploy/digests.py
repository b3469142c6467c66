"""The model digests apply trusts without reading the file again: its stamps.

Owns ``<root>/var/lib/slmguard-apply/digests.json``: for each large file apply
hashed (the model it was given, the model it installed, the previous
deployment's model), the SHA-256 it found and the file's device, inode, size
and mtime at that moment. A later apply, ``render`` of the installed plan or
``rollback --to previous`` takes the digest from the stamp when all four still
match, and hashes the file again when any differs. So a run that changes
nothing reads no model bytes (a 2 GB model on an SD card is a minute of reads
per board and run).

What a stamp trusts: a write through the file system changes the mtime; a new
file (a download, a copy, ``mv`` over it) has another inode. It is fooled only
by a write that sets the mtime back on purpose (``touch -d``), which needs the
file's owner, root here. The ctime is left out on purpose: making a hard link
(apply's install, the previous deployment's snapshot) changes it without
changing a byte.

The file lives in apply's root-only directory (0700, beside the manifest,
which ``slmguard rollback`` removes with it) and is read as hostile like the
manifest: entries of the wrong shape are dropped, never trusted. Apply writes
it only when it writes the deployment, or when it had to hash a model on a
run that changed nothing and its directory exists (a cache, not a file of the
deployment). ``slmguard stage`` stamps the model it staged (downloaded and
hashed as it came, or hashed once) here too, making the directory when there
is no apply yet, so apply does not read it again.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from slmguard import atomicio
from slmguard.deploy.manifest import APPLY_DIR, apply_dir
from slmguard.deploy.rootpath import confine
from slmguard.errors import HostWriteError, RefusedError

DIGESTS_NAME = "digests.json"
DIGESTS_DEST = f"{APPLY_DIR}/{DIGESTS_NAME}"
SCHEMA = "slmguard.digests/1"
#: Entries kept (the newest first): a board holds a handful of models at most.
MAX_ENTRIES = 32
_MAX_BYTES = 64 << 10
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KEYS = ("dev", "ino", "size", "mtime_ns")


def _stamp(st: os.stat_result) -> dict[str, int]:
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _valid(e: object) -> bool:
    return (
        isinstance(e, dict)
        and isinstance(e.get("path"), str)
        and isinstance(e.get("sha256"), str)
        and _SHA256.fullmatch(e["sha256"]) is not None
        and all(isinstance(e.get(k), int) and not isinstance(e.get(k), bool) for k in _KEYS)
    )


@dataclass
class Digests:
    """The stamps of one root, by the file's absolute host path (symlinks resolved)."""

    root: Path
    entries: list[dict[str, object]] = field(default_factory=list)
    changed: bool = False  # a stamp was added since load: worth writing

    def trusted(self, path: Path) -> str | None:
        """``path``'s digest when its stamp still matches the file; None otherwise."""
        real = os.path.realpath(path)
        try:
            now = _stamp(os.stat(real))
        except OSError:
            return None
        for e in self.entries:
            if e["path"] == real and all(e[k] == v for k, v in now.items()):
                return str(e["sha256"])
        return None

    def holding(self, sha256: str) -> list[Path]:
        """The files whose stamp still vouches for ``sha256`` (nothing read but their stat)."""
        out = []
        for e in self.entries:
            path = Path(str(e["path"]))
            if e["sha256"] == sha256 and self.trusted(path) == sha256:
                out.append(path)
        return out

    def remember(self, path: Path, sha256: str) -> None:
        """Stamp ``path`` (as it is now) with the digest it was found to have."""
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
        except OSError:
            return
        entry: dict[str, object] = {"path": real, **_stamp(st), "sha256": sha256}
        if entry not in self.entries:
            self.changed = True
        kept = [e for e in self.entries if e["path"] != real]
        self.entries = [entry, *kept][:MAX_ENTRIES]

    def save(self, *, create: bool = False) -> None:
        """Write the stamps (atomically, 0600) when something changed and apply's dir exists
        (``create``: make it, 0700, as ``slmguard stage`` does before the first apply)."""
        directory = apply_dir(self.root)
        if not self.changed:
            return
        if create and not directory.is_dir():
            confine(self.root, APPLY_DIR, where="apply's directory")
            try:
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as err:
                raise HostWriteError(directory, err.strerror or str(err)) from err
        if not directory.is_dir():
            return
        path = confine(self.root, DIGESTS_DEST, where="the model digests")
        data = {"schema": SCHEMA, "entries": self.entries}
        try:
            atomicio.write_atomic(path, (json.dumps(data, indent=1) + "\n").encode(), 0o600)
        except OSError as err:
            raise HostWriteError(path, err.strerror or str(err)) from err
        self.changed = False


def load_digests(root: Path) -> Digests:
    """The stamps under ``root`` (none when the file is missing, unreadable or not ours)."""
    try:
        path = confine(root, DIGESTS_DEST, follow=True, where="the model digests")
        with path.open("rb") as f:
            raw = f.read(_MAX_BYTES + 1)
        data = json.loads(raw) if len(raw) <= _MAX_BYTES else None
    except (OSError, ValueError, RecursionError, RefusedError):
        return Digests(root)  # RefusedError: a link out of the root is not trusted
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return Digests(root)
    entries = data.get("entries")
    good = [e for e in entries if _valid(e)] if isinstance(entries, list) else []
    return Digests(root, good[:MAX_ENTRIES])
