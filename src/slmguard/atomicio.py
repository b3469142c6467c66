"""Atomic file replacement: the one way slmguard puts a file, link or hard link in place.

Owns the recipe, used by ``apply``/``rollback`` (everything under the target
root), ``render --out``, the watcher's state file and the default model's
assembly: a temporary name beside the target (``.NAME.slmguard-tmp-PID``), the
data written and fsync'ed with its mode (and owner, when root asks) set on the
open descriptor, a rename over the target, then an fsync of the directory.
Readers and a power cut see the old file or the new one, never half of it.

The temporary is created with ``O_EXCL | O_NOFOLLOW`` after any leftover of
that name is removed, so a link planted under the temporary name is not
followed. On any failure the temporary is removed and the ``OSError`` goes to
the caller unchanged: each caller translates it into its own error at its edge
(apply: :class:`~slmguard.errors.HostWriteError`; the default model:
:class:`~slmguard.errors.ModelError`). Nothing here decides where a file may
go: ``slmguard.deploy.rootpath`` checks that before ``apply`` calls in.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

#: Between a file's name and the writer's pid in its temporary's name.
TMP_INFIX = ".slmguard-tmp-"


def tmp_name(path: Path) -> Path:
    """The temporary name used beside ``path`` (hidden, per process)."""
    return path.with_name(f".{path.name}{TMP_INFIX}{os.getpid()}")


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable; file systems that refuse (vfat) are let be."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems (vfat on older kernels) refuse fsync on a dir
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary name beside ``path``, renamed over it (and the directory synced) on exit.

    The body creates the temporary; an exception in it (or in the rename)
    removes the temporary and propagates.
    """
    tmp = tmp_name(path)
    try:
        tmp.unlink(missing_ok=True)  # a leftover of a crashed run with this pid
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_writer(
    path: Path,
    mode: int = 0o644,
    owner: tuple[int, int] | None = None,
    mtime_ns: int | None = None,
) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; put in place when the block ends.

    ``mode`` is set on the descriptor before the first byte (never wider while
    written: the file is created 0600); ``owner`` is applied only when running
    as root; ``mtime_ns`` sets both times. An exception in the block leaves
    ``path`` as it was.

    Example::

        with atomic_writer(Path("/etc/x.conf"), 0o644) as out:
            out.write(b"key = 1\\n")
    """
    with replacing(path) as tmp:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        with os.fdopen(fd, "wb") as out:
            os.fchmod(fd, mode)
            if owner is not None and os.geteuid() == 0:
                os.fchown(fd, *owner)
            yield out
            out.flush()
            os.fsync(fd)
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))


def write_atomic(
    path: Path,
    data: bytes,
    mode: int = 0o644,
    owner: tuple[int, int] | None = None,
    mtime_ns: int | None = None,
) -> None:
    """Replace ``path`` with ``data`` (see :func:`atomic_writer`)."""
    with atomic_writer(path, mode, owner, mtime_ns) as out:
        out.write(data)


def symlink_atomic(path: Path, target: str) -> None:
    """Point ``path`` at ``target`` in one rename (a link or file there before is replaced)."""
    with replacing(path) as tmp:
        os.symlink(target, tmp)


def link_atomic(path: Path, source: Path) -> None:
    """Make ``path`` a hard link of ``source`` in one rename (same file system only: EXDEV)."""
    with replacing(path) as tmp:
        os.link(source, tmp, follow_symlinks=False)
