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
import errno
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from slmguard import atomicio
from slmguard.deploy.rootpath import confine, relative_dest
from slmguard.errors import HostWriteError, ModelError

#: Read size when copying the model (and the step of its progress reports).
COPY_BLOCK_BYTES = 8 << 20


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
                path.chmod(mode)  # whatever the umask: the services must traverse /etc/slmguard
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

    def hardlink(self, dest: str, source: Path) -> bool:
        """Make ``dest`` a hard link of ``source``; False when the file system cannot.

        (Another file system, EXDEV; one without hard links, or a link count at
        its limit; or a kernel with protected_hardlinks refusing, EPERM.)
        """
        path = self.path(dest)
        try:
            atomicio.link_atomic(path, source)
        except OSError as err:
            if err.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                return False
            raise HostWriteError(path, err.strerror or str(err)) from err
        return True

    def copy(
        self,
        dest: str,
        source: Path,
        *,
        sha256: str,
        mode: int = 0o644,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Copy ``source`` to ``dest`` atomically, hashing while copying.

        A copy whose digest is not ``sha256`` (the file changed since it was
        checked) is not put in place: ModelError.
        """
        path = self.path(dest)
        digest = hashlib.sha256()
        try:
            src = source.open("rb")
        except OSError as err:
            raise ModelError(source, f"cannot read: {err.strerror or err}") from err
        with src, writing(path), atomicio.atomic_writer(path, mode) as out:
            total = os.fstat(src.fileno()).st_size
            done = 0
            while block := src.read(COPY_BLOCK_BYTES):
                out.write(block)
                digest.update(block)
                done += len(block)
                if progress is not None:
                    progress(done, total)
            if digest.hexdigest() != sha256:
                raise ModelError(source, "changed while it was copied (sha256 differs)")

    def set_attributes(self, dest: str, owner: tuple[int, int], mtime_ns: int) -> None:
        """Give ``dest`` (a file, never followed) this owner and mtime."""
        path = self.path(dest)
        with writing(path):
            os.chown(path, *owner, follow_symlinks=False)
            os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)

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
