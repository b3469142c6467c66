"""A file's sha256 under a root, streamed: what ``doctor --verify-model`` compares with the plan.

Owns reading one regular file (never through a link out of the root, never a
FIFO or device) in blocks and hashing it, with its size. Reads every byte: a
model of a few GB on an SD card takes a minute, which is why the doctor asks
for it only with ``--verify-model``. Raises HostReadError for anything it
cannot read; ``host.snapshot`` turns that into an ``Unread``.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError

BLOCK_BYTES = 4 << 20


@dataclass(frozen=True)
class FileDigest:
    """A file as its bytes are now: where, how many, their sha256."""

    path: str  # the path as the plan names it (on the target)
    size_bytes: int
    sha256: str


def read_file_digest(root: Path, dest: str) -> FileDigest:
    """``dest`` (an absolute path on the target) under ``root``, hashed."""
    if not dest.startswith("/"):
        raise HostReadError(dest, "not an absolute path")
    path = root / dest.lstrip("/")
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
        raise HostReadError(path, f"resolves to {real}, outside {root}")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise HostReadError(path, err.strerror or str(err)) from err
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise HostReadError(path, "is not a regular file")
        h = hashlib.sha256()
        size = 0
        try:
            while block := f.read(BLOCK_BYTES):
                h.update(block)
                size += len(block)
        except OSError as err:
            raise HostReadError(path, err.strerror or str(err)) from err
    return FileDigest(dest, size, h.hexdigest())
