"""The deployment's writes under a root: directories, files, links and removals.

Owns every change ``apply`` and ``rollback`` make to the target. A
:class:`RootWriter` takes destinations (``/etc/fstab``), never host paths:
each is checked by :func:`slmguard.deploy.rootpath.confine` again just before
it is touched (the callers checked them all before the first write), each
write goes through :mod:`slmguard.atomicio` (readers see the old file or the
new one), and each ``OSError`` becomes a :class:`~slmguard.errors.HostWriteError`
(exit 73) naming the path. Nothing else in ``slmguard.deploy`` writes outside
the review tree of ``render --out``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from slmguard import atomicio
from slmguard.deploy.rootpath import confine, relative_dest
from slmguard.errors import HostWriteError


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn an OSError in the block into a HostWriteError naming ``path``."""
    try:
        yield
    except OSError as err:
        raise HostWriteError(path, err.strerror or str(err)) from err


@dataclass(frozen=True)
class RootWriter:
    """Writes below ``root``, addressed by destination."""

    root: Path

    def path(self, dest: str) -> Path:
        return confine(self.root, dest)

    def missing_dirs(self, dest: str) -> list[str]:
        """The directories on the way to ``dest`` (itself included) that do not exist, top first."""
        missing: list[str] = []
        p = self.path(dest)
        while p != self.root and p != p.parent and not p.exists():
            missing.append(relative_dest(self.root, p))
            p = p.parent
        return list(reversed(missing))

    def make_dirs(self, dest: str, mode: int = 0o755) -> list[str]:
        """Create ``dest`` and its missing parents; the ones it created, top first."""
        created = self.missing_dirs(dest)
        for d in created:
            path = self.path(d)
            with writing(path):
                path.mkdir(mode=mode, exist_ok=True)
        return created

    def chmod(self, dest: str, mode: int) -> None:
        path = self.path(dest)
        with writing(path):
            path.chmod(mode)

    def write(
        self,
        dest: str,
        data: bytes,
        mode: int = 0o644,
        owner: tuple[int, int] | None = None,
        mtime_ns: int | None = None,
    ) -> None:
        path = self.path(dest)
        with writing(path):
            atomicio.write_atomic(path, data, mode, owner, mtime_ns)

    def link(self, dest: str, target: str) -> None:
        path = self.path(dest)
        with writing(path):
            atomicio.symlink_atomic(path, target)

    def remove(self, dest: str) -> None:
        """Remove a file or symlink (never what a link points to)."""
        path = self.path(dest)
        with writing(path):
            path.unlink()

    def remove_dir(self, dest: str) -> bool:
        """Remove an empty directory; False when it is gone already or not empty."""
        path = self.path(dest)
        try:
            path.rmdir()
        except OSError:  # missing, or not empty: something else was put there since
            return False
        return True
