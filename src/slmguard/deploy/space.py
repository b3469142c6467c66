"""Will apply's writes fit? Each filesystem under the root, checked before the first write.

Owns :func:`needed_bytes` (pure: what apply is about to write, by destination: each new
file rounded up to blocks, and the bytes of each file it replaces twice more, for its
backup and its copy under ``previous-<gen>/`` in apply's own directory, plus the
manifest) and :func:`check_space`, which adds those up per filesystem (``st_dev`` of the
nearest directory that exists on the way to each destination) and compares them with
what ``statvfs`` says is free for an unprivileged writer. A filesystem that would not
hold them refuses the apply with :class:`~slmguard.errors.NoSpaceError` (73) before
anything is written: a full disk must not leave half a deployment, and apply's own
backups are what rollback needs. The estimate errs high (a block per file more, 256 KiB
for the manifest). It writes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from slmguard.deploy.changes import Change, Removal
from slmguard.deploy.manifest import APPLY_DIR, MANIFEST_DEST
from slmguard.deploy.modelfile import can_link
from slmguard.deploy.rootpath import confine
from slmguard.errors import NoSpaceError

BLOCK_BYTES = 4096
MANIFEST_BYTES = 256 << 10  # the manifest and its atomic copy, with room to grow


def _blocks(n: int) -> int:
    """``n`` bytes as whole blocks, and one more (the inode's, a directory entry's)."""
    return -(-n // BLOCK_BYTES) * BLOCK_BYTES + BLOCK_BYTES


def _old_size(change: Change) -> int:
    current = change.current
    if current.kind != "file":
        return 0
    if current.data is not None:
        return len(current.data)
    return current.size_bytes or 0


def needed_bytes(
    changes: Iterable[Change], removals: Iterable[Removal], *, linked: Collection[str]
) -> dict[str, int]:
    """Bytes apply writes, by destination (its own directory under :data:`APPLY_DIR`).
    ``linked``: the destinations of the models that go in as a hard link (no bytes) rather
    than a copy (:func:`model_links`)."""
    need: dict[str, int] = {MANIFEST_DEST: MANIFEST_BYTES}
    saved = 0
    for c in changes:
        f = c.file
        if f.model is not None:
            size = 0 if c.path in linked else f.model.size_bytes
        elif f.content is not None:
            size = len(f.content)
        else:  # a link, or a secret of a few bytes
            size = f.secret_bytes or 0
        need[c.path] = need.get(c.path, 0) + _blocks(size)
        if f.model is None:  # apply keeps no backup of a model it replaces
            saved += 2 * _blocks(_old_size(c))
    for r in removals:
        if r.current.kind == "file":
            saved += 2 * _blocks(len(r.current.data or b"") or r.current.size_bytes or 0)
    need[APPLY_DIR] = need.get(APPLY_DIR, 0) + saved
    return need


def _existing(path: Path) -> Path:
    """``path`` or the nearest directory above it that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_space(root: Path, need: Mapping[str, int]) -> None:
    """Raise NoSpaceError for the first filesystem whose free space is below what apply
    would write to it; destinations are confined to ``root``."""
    per_fs: dict[int, tuple[Path, int]] = {}
    for dest, size in need.items():
        where = _existing(confine(root, dest))
        dev = os.stat(where).st_dev
        seen, total = per_fs.get(dev, (where, 0))
        per_fs[dev] = (seen, total + size)
    for where, total in per_fs.values():
        st = os.statvfs(where)
        free = st.f_bavail * st.f_frsize
        if total > free:
            raise NoSpaceError(where, total, free)


def model_links(changes: Iterable[Change], root: Path) -> frozenset[str]:
    """The destinations of the models (a board's may be several) that would go in as a hard
    link: linkable and on the same filesystem as their destination."""
    return frozenset(
        c.path
        for c in changes
        if c.file.model is not None and _links(c.file.model.source, root, c.path)
    )


def _links(source: Path, root: Path, dest: str) -> bool:
    if not can_link(source):
        return False
    try:
        return os.stat(source).st_dev == os.stat(_existing(confine(root, dest))).st_dev
    except OSError:
        return False
