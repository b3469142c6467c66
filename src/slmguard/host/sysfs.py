"""One sysfs (or debugfs, or procfs) attribute read that tells absent, needs root and broken apart.

Owns :func:`read_attr` and the wording of its outcome. The board readers
(``thermal``, ``accel``, ``cpustat``) show what a file said, or why it said
nothing: a missing file means the kernel does not have the feature, an
``EACCES`` means the value exists but only root may read it (debugfs is
mode 0700, ``cpuinfo_cur_freq`` is 0400), and anything else (``EINVAL`` or
``ENODATA`` from a thermal sensor that is switched off, ``EIO`` from a
driver) is reported with its errno text. Nothing reads zeros in place of an
answer. Nothing here writes.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path

NEEDS_ROOT = "needs root"

#: An attribute file is small; anything longer is truncated (a hostile or broken driver).
MAX_ATTR_BYTES = 64 << 10


@dataclass(frozen=True)
class Attr:
    """What one attribute read gave: ``text``, or ``error`` (None and None: no such file)."""

    text: str | None = None
    error: str | None = None

    @property
    def missing(self) -> bool:
        return self.text is None and self.error is None

    def integer(self) -> int | None:
        """The text as an integer, None when absent, unreadable or not a number."""
        if self.text is None:
            return None
        try:
            return int(self.text.strip())
        except ValueError:
            return None


def os_error_text(err: OSError) -> str:
    """``needs root`` for EACCES/EPERM, else the errno's text."""
    if isinstance(err, PermissionError) or err.errno in (errno.EACCES, errno.EPERM):
        return NEEDS_ROOT
    return err.strerror or type(err).__name__


def read_attr(path: Path) -> Attr:
    """Read one attribute: its text, or why not. Never raises for OS errors."""
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_ATTR_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return Attr()
    except OSError as err:
        return Attr(error=os_error_text(err))
    return Attr(text=data.decode("utf-8", errors="replace"))


def probe(path: Path) -> str | None:
    """Whether ``path`` exists: ``"yes"``, ``"no"`` or :data:`NEEDS_ROOT` (a directory
    on the way is not searchable, as ``/sys/kernel/debug`` is for other users)."""
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return "no"
    except PermissionError:
        return NEEDS_ROOT
    except OSError:
        return "no"
    return "yes"
