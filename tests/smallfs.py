"""A real small filesystem that fills up, for full-disk tests (issue 40).

:func:`small_tmpfs` mounts a tmpfs of a given size (root only; skipped with the reason
elsewhere), :func:`fill` writes a filler file until the kernel says ENOSPC and
:func:`free` removes it: the disk is full for real, every write below it fails the way
it fails on a board's SD card.

Example::

    with small_tmpfs(tmp_path / "state", 8 << 20) as fs:
        filler = fill(fs)
        ...                       # writes fail with ENOSPC
        free(filler)
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "mounting a small tmpfs needs root"
    return None


@contextlib.contextmanager
def small_tmpfs(where: Path, size_bytes: int) -> Iterator[Path]:
    """``where`` as a tmpfs of ``size_bytes`` (mode 0700) for the block; unmounted after."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "slmguard-test",
         str(where)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def fill(fs: Path, name: str = ".filler") -> Path:
    """Write ``fs/name`` until the filesystem is full (ENOSPC); return its path."""
    path = fs / name
    chunk = b"\0" * (64 << 10)
    with path.open("ab", buffering=0) as fh:
        for size in (len(chunk), 4096, 1):
            try:
                while fh.write(chunk[:size]):
                    pass
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
    return path


def free(filler: Path) -> None:
    filler.unlink(missing_ok=True)


def free_bytes(fs: Path) -> int:
    st = os.statvfs(fs)
    return st.f_bavail * st.f_frsize
