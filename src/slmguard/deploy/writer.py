"""The deployment's writes under a root: directories, files, links and removals.

Owns every change ``apply`` and ``rollback`` make to the target: each goes
through :mod:`slmguard.atomicio` (readers see the old file or the new one),
and each ``OSError`` becomes a :class:`~slmguard.errors.HostWriteError`
(exit 73) naming the destination. Nothing else in ``slmguard.deploy`` writes
outside the review tree of ``render --out``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from slmguard import atomicio
from slmguard.errors import HostWriteError


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn an OSError in the block into a HostWriteError naming ``path``."""
    try:
        yield
    except OSError as err:
        raise HostWriteError(path, err.strerror or str(err)) from err


def missing_dirs(path: Path, stop: Path) -> list[Path]:
    """Ancestors of ``path`` (itself included) below ``stop`` that do not exist, top first."""
    missing: list[Path] = []
    p = path
    while p != stop and p != p.parent and not p.exists():
        missing.append(p)
        p = p.parent
    return list(reversed(missing))


def make_dirs(dirs: list[Path]) -> None:
    for d in dirs:
        with writing(d):
            d.mkdir(mode=0o755, exist_ok=True)


def write_file(
    path: Path,
    data: bytes,
    mode: int = 0o644,
    owner: tuple[int, int] | None = None,
    mtime_ns: int | None = None,
) -> None:
    with writing(path):
        atomicio.write_atomic(path, data, mode, owner, mtime_ns)


def write_link(path: Path, target: str) -> None:
    with writing(path):
        atomicio.symlink_atomic(path, target)


def remove(path: Path) -> None:
    """Remove a file or symlink (never what a link points to)."""
    with writing(path):
        path.unlink()
