"""Opening a file that may be hostile: never blocking, never reading more than asked.

A model file comes from the internet and a plan is edited by hand; either path
may name a FIFO, a device or a directory. :func:`open_regular` opens with
``O_NONBLOCK`` (a plain open of a FIFO waits for a writer forever, a tty or
device may stall), then ``fstat`` on the opened descriptor decides, so the check
and the read see the same file. Callers turn the errors into their own
(:class:`~slmguard.errors.ModelError` for a model, ``ConfigError`` for a plan,
an unread host fact for the audit).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


class NotRegularFileError(OSError):
    """The path opened is not a regular file; ``kind`` says what it is."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(f"{path} is {kind}, not a regular file")
        self.path = path
        self.kind = kind


def file_kind(mode: int) -> str:
    """ "a FIFO (named pipe)", "a directory", ... for an ``st_mode`` that is not a regular file."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path: Path) -> IO[bytes]:
    """``path`` opened for binary reading if it is a regular file.

    Raises what ``os.open`` raises (FileNotFoundError, NotADirectoryError,
    PermissionError...) or :class:`NotRegularFileError`.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(path, file_kind(st.st_mode))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: Path, max_bytes: int) -> bytes | None:
    """A regular file's bytes, or None when it holds more than ``max_bytes``."""
    with open_regular(path) as f:
        raw = f.read(max_bytes + 1)
    return None if len(raw) > max_bytes else raw
